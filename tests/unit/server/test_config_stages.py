"""joaderd's per-source stage settings: upscale by default (`--no-upscale NAME`, `upscale =
false`), `--exif-transpose NAME` / `exif_transpose = true`, and the three decoders."""

from __future__ import annotations

from pathlib import Path

import pytest

from joader.errors import InvalidArgumentError
from joader.server.config import load_config


@pytest.fixture(autouse=True)
def no_env_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOADER_ADDRESS", raising=False)


def _sources(argv: list[str]) -> dict[str, tuple[bool, bool, str]]:
    return {s.name: (s.upscale, s.exif_transpose, s.decoder) for s in load_config(argv).sources}


def test_images_are_upscaled_and_not_turned_by_default(tmp_path: Path) -> None:
    assert _sources(["--source", f"a={tmp_path}"]) == {"a": (True, False, "turbo")}


def test_flags_per_source(tmp_path: Path) -> None:
    argv = ["--source", f"a={tmp_path}", "--source", f"b={tmp_path}", "--source", f"c={tmp_path}",
            "--no-upscale", "a", "--upscale", "b", "--exif-transpose", "b", "--decoder", "pil-draft"]
    assert _sources(argv) == {"a": (False, False, "pil-draft"), "b": (True, True, "pil-draft"),
                              "c": (True, False, "pil-draft")}


def test_toml_keys_and_flags_winning(tmp_path: Path) -> None:
    path = tmp_path / "joaderd.toml"
    path.write_text(f'decoder = "pil"\n[sources.a]\npath = "{tmp_path}"\nupscale = false\nexif_transpose = true\n'
                    f'[sources.b]\npath = "{tmp_path}"\nupscale = false\n')
    assert _sources(["--config", str(path)]) == {"a": (False, True, "pil"), "b": (False, False, "pil")}
    assert _sources(["--config", str(path), "--upscale", "b"])["b"] == (True, False, "pil")


@pytest.mark.parametrize(("argv", "fix"), [
    (["--no-upscale", "b"], "--no-upscale 'b': no source named 'b'; known: a"),
    (["--exif-transpose", "x"], "--exif-transpose 'x': no source named 'x'"),
    (["--upscale", "a", "--no-upscale", "a"], "both name 'a'; keep one"),
])  # fmt: skip
def test_bad_flags_name_the_fix(tmp_path: Path, argv: list[str], fix: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fix):
        load_config(["--source", f"a={tmp_path}", *argv])


@pytest.mark.parametrize(("line", "fix"), [
    ('exif_transpose = "yes"', "exif_transpose of .* expected true or false, got 'yes'; write e.g. exif_transpose = true"),
    ("upscale = 0", "upscale of .* expected true or false, got 0; write e.g. upscale = false"),
    ('decoder = "pillow"', "'pil' or 'pil-draft' or 'turbo'"),
    ("exif_transpos = true", "did you mean exif_transpose"),
])  # fmt: skip
def test_bad_toml_values_name_the_key(tmp_path: Path, line: str, fix: str) -> None:
    path = tmp_path / "joaderd.toml"
    path.write_text(f'[sources.a]\npath = "{tmp_path}"\n{line}\n')
    with pytest.raises(InvalidArgumentError, match=fix):
        load_config(["--config", str(path)])
