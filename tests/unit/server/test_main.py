"""joaderd's glue (server/main.py) that needs no server: the idle thread stops serving once the
registry says so, the arena's size is `--cache-size` as given or chosen and logged (auto), and
the supervisor's two kinds of failure (a dead thread, a dead Next front).
A real joaderd runs in tests/integration/test_unattended.py."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from joader.errors import CacheSpaceError
from joader.server import main as main_module
from joader.server.config import ServerConfig, SourceConfig
from joader.stages import build_stage

pytestmark = pytest.mark.timeout(30)


class _Registry:
    """Says "idle for 2.0 s" at its third question."""

    def __init__(self) -> None:
        self.asked = 0

    def exit_if_idle(self) -> float | None:
        self.asked += 1
        return 2.04 if self.asked == 3 else None


def test_the_idle_thread_stops_serving_once_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    registry, stopping, stops = _Registry(), threading.Event(), []
    with caplog.at_level(logging.INFO, logger="joader.server"):
        main_module._exit_when_idle(registry, 0.5, stopping, lambda: stops.append(1))  # type: ignore[arg-type]
    assert (registry.asked, stops) == (3, [1])
    assert "joaderd: no job for 2.0 s (--idle-exit-s); exiting" in caplog.text


def test_the_idle_thread_ends_with_joaderd() -> None:
    registry, stopping = _Registry(), threading.Event()
    stopping.set()
    main_module._exit_when_idle(registry, 600.0, stopping, lambda: pytest.fail("stopped"))  # type: ignore[arg-type]
    assert registry.asked == 0


def _sources(items: int) -> list[SimpleNamespace]:
    stage = build_stage("center-crop", size=64)
    return [SimpleNamespace(name="demo", num_items=items, max_item_bytes=stage.spec.max_nbytes, stage=stage)]


def test_an_explicit_cache_size_is_used_as_given(tmp_path: Path) -> None:
    config = ServerConfig(sources=(SourceConfig("demo", tmp_path),), cache_size_bytes=5 << 20)
    chosen = main_module._cache_size(config, _sources(160), 12288)  # type: ignore[arg-type]
    assert (chosen.size_bytes, chosen.dataset_bytes, chosen.reason) == (5 << 20, 160 * 12288, "set by --cache-size")


def test_auto_reads_the_host_and_logs_its_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    config = ServerConfig(sources=(SourceConfig("demo", tmp_path),), cache_size_bytes=None)
    monkeypatch.setattr(main_module, "host_memory", lambda: (1 << 40, 1 << 40))
    with caplog.at_level(logging.INFO, logger="joader.server"):
        chosen = main_module._cache_size(config, _sources(160), 12288)  # type: ignore[arg-type]
    assert chosen.size_bytes == 160 * 12288 * 17 // 16
    # center-crop's bound is every item's size but a smaller image's: counted as exact
    assert "--cache-size auto: cache 2.0 MiB = the whole prepared dataset (1.9 MiB for 160 items, plus 1/16)" \
        in caplog.text


def test_auto_without_a_dev_shm_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> tuple[int, int]:
        raise FileNotFoundError(2, "No such file or directory", "/dev/shm")

    monkeypatch.setattr(main_module, "host_memory", missing)
    config = ServerConfig(sources=(SourceConfig("demo", tmp_path),), cache_size_bytes=None)
    with pytest.raises(CacheSpaceError, match="cannot read the free space of /dev/shm.*give --cache-size a size"):
        main_module._cache_size(config, _sources(160), 12288)  # type: ignore[arg-type]


def test_a_dead_thread_makes_every_request_fail_but_a_dead_front_only_stops_joaderd(
        caplog: pytest.LogCaptureFixture) -> None:
    """A thread's death leaves the books in doubt: every request answers ServerFailedError until
    the exit. A Next front's death does not (NOTE [ Next fronts ]): its jobs must wait for a
    restart as after a kill (the chaos soak's first front kill ended a job with
    ServerFailedError). Both exit 70 (`failure` is set), the first failure wins."""
    calls: list[tuple[str, bool]] = []
    supervisor = main_module.Supervisor(lambda reason, refuse: calls.append((reason, refuse)))
    supervisor.stop_failed("Next front 0 (pid 1) exited")
    assert calls == [("Next front 0 (pid 1) exited", False)]
    assert supervisor.failure == "Next front 0 (pid 1) exited"
    assert "Next front 0 (pid 1) exited" in caplog.text

    calls.clear()
    threads = main_module.Supervisor(lambda reason, refuse: calls.append((reason, refuse)))
    threads.spawn("joaderd-test", lambda: 1 / 0)
    threads.join(timeout_s=5)
    assert calls == [("thread joaderd-test died: ZeroDivisionError: division by zero", True)]
    threads.stop_failed("later")  # the first failure stands
    assert threads.failure == "thread joaderd-test died: ZeroDivisionError: division by zero"
    assert len(calls) == 1
