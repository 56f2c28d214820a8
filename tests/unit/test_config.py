"""joaderd's settings (flags, TOML, errors) and address resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from joader.address import resolve_address, socket_path
from joader.errors import InvalidArgumentError
from joader.server.config import load_config


def test_flags_give_sources_sizes_and_settings(tmp_path: Path) -> None:
    config = load_config(["--source", f"a={tmp_path}", "--source", f"b={tmp_path}",
                          "--image-size", "224", "--image-size", "b=128", "--cache-size", "2GiB",
                          "--workers", "3", "--listen", "127.0.0.1:7070"])
    assert [(s.name, s.image_size) for s in config.sources] == [("a", 224), ("b", 128)]
    assert config.cache_size_bytes == 2 * 2**30
    assert config.num_workers == 3
    assert config.listen == "127.0.0.1:7070"


def test_toml_config_with_flags_winning(tmp_path: Path) -> None:
    path = tmp_path / "joaderd.toml"
    path.write_text(f'cache_size = "64MiB"\nworkers = 1\nimage_size = 96\n'
                    f'[sources.imagenet]\npath = "{tmp_path}"\nimage_size = 200\n'
                    f'[sources.small]\npath = "{tmp_path}"\n')
    config = load_config(["--config", str(path), "--workers", "2"])
    assert {s.name: s.image_size for s in config.sources} == {"imagenet": 200, "small": 96}
    assert config.cache_size_bytes == 64 * 2**20
    assert config.num_workers == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "nothing to serve"),
        (["--source", "x"], "NAME=PATH"),
        (["--source", "x=/d", "--image-size", "y=10"], "no source named 'y'"),
        (["--source", "x=/d", "--image-size", "0"], "positive integer"),
        (["--source", "x=/d", "--workers", "0"], "positive integer"),
        (["--source", "x=/d", "--lease-s", "0"], "positive"),
    ],
)
def test_bad_settings_name_the_problem(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        load_config(argv)


def test_addresses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("JOADER_ADDRESS", raising=False)
    assert resolve_address("unix:///tmp/x.sock") == "unix:/tmp/x.sock"
    assert resolve_address("/tmp/x.sock") == "unix:/tmp/x.sock"
    assert resolve_address("127.0.0.1:7070") == "127.0.0.1:7070"
    assert socket_path("unix:/tmp/x.sock") == Path("/tmp/x.sock")
    assert socket_path("127.0.0.1:7070") is None
    monkeypatch.setenv("JOADER_ADDRESS", "127.0.0.1:9")
    assert resolve_address() == "127.0.0.1:9"
    monkeypatch.delenv("JOADER_ADDRESS")
    assert resolve_address().startswith("unix:") and resolve_address().endswith("joaderd.sock")
    with pytest.raises(InvalidArgumentError, match="HOST:PORT"):
        resolve_address("nonsense")
