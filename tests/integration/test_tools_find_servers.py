"""`joader status`, `top --once` and `analyze` with no address find the joaderds that jobs with
`root=` started (issue 38): the one there is, a list and a question when there are two, the one
`--source` names. Real auto-started servers (`ensure_server`, what `JoaderDataset(root=...)`
calls) in a private XDG_RUNTIME_DIR; the tools run in this process, as `joader` would run them.

Before: a bare `joader status` looked only at the default socket and said "no joaderd is
answering at .../joaderd.sock ... pass root=PATH to JoaderDataset and it starts one itself"
while the user's root= server ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from joader.client.autostart import ServerSpec, ensure_server
from joader.client.tools.cli import main
from tests.support.processes import IMAGE_SIZE, private_runtime_dir

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR for this test's servers and tools; every server started under
    it is stopped afterwards."""
    with private_runtime_dir("jt-") as path:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
        for name in ("JOADER_ADDRESS", "JOADER_IDLE_EXIT_S", "JOADER_SERVE_OWNER"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("JOADER_CACHE_SIZE", "4MiB")
        yield path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tools_find_the_servers_root_jobs_started(demo_root: Path, runtime_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "status")
    assert code == 1
    assert f"{runtime_dir}/joader/joaderd.sock" in err and f"{runtime_dir}/joader/auto-*.sock" in err
    assert "exits 10 minutes after its last job ends" in err

    first, _ = ensure_server(ServerSpec.make("demo", demo_root, image_size=IMAGE_SIZE))
    code, out, err = _run(capsys, "status")
    assert code == 0, err
    assert f"joaderd at {first}" in out and str(demo_root) in out
    assert "showing the joaderd a job started for demo" in err
    code, out, err = _run(capsys, "top", "--once", "--interval", "0.2")
    assert code == 0, err
    assert first in out.replace("\n", "")
    code, out, err = _run(capsys, "analyze", "--interval", "0.5")
    assert code == 0, err
    assert "no jobs attached" in out

    second, _ = ensure_server(ServerSpec.make("other", demo_root, image_size=IMAGE_SIZE))
    for tool in (["status"], ["top", "--once", "--interval", "0.2"], ["analyze", "--interval", "0.5"]):
        code, out, err = _run(capsys, *tool)
        assert code == 1 and not out
        assert "2 joaderds of yours are running" in err and first in err and second in err
        assert f"`joader {tool[0]} --source demo`" in err
    code, out, err = _run(capsys, "status", "--source", "other")
    assert code == 0, err
    assert f"joaderd at {second}" in out
    code, out, err = _run(capsys, "top", "--once", "--interval", "0.2", "--source", "demo")
    assert code == 0 and first in out.replace("\n", ""), err
    code, out, err = _run(capsys, "analyze", "--interval", "0.5", "--source", "other")
    assert code == 0 and "no jobs attached" in out, err
