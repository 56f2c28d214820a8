"""joaderd's job settings: --rank-attach-timeout-s (how long a job waits for its missing ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from joader.errors import InvalidArgumentError
from joader.server.config import load_config


@pytest.fixture(autouse=True)
def no_env_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOADER_ADDRESS", raising=False)


def test_rank_attach_timeout_from_flag_and_toml(tmp_path: Path) -> None:
    assert load_config(["--source", f"a={tmp_path}"]).rank_attach_timeout_s == 60.0
    assert load_config(["--source", f"a={tmp_path}", "--rank-attach-timeout-s", "5"]).rank_attach_timeout_s == 5.0
    toml = tmp_path / "joaderd.toml"
    toml.write_text(f'rank_attach_timeout_s = 12.5\n[sources.a]\npath = "{tmp_path}"\n')
    assert load_config(["--config", str(toml)]).rank_attach_timeout_s == 12.5
    with pytest.raises(InvalidArgumentError, match="--rank-attach-timeout-s"):
        load_config(["--source", f"a={tmp_path}", "--rank-attach-timeout-s", "0"])
