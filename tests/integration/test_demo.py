"""`make demo` as a newcomer runs it: three joader jobs, then the same jobs with plain
DataLoaders, and a summary that says what happened and what to do next (issue 38)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from joader.client.tools.demo import JobReport, summarize


def _report(name: str, items: int, epochs: list[tuple[int, int]]) -> JobReport:
    return JobReport(name, items, [{"received": r, "distinct": d} for r, d in epochs], 1.0)


def test_the_summary_says_what_was_read_decoded_and_timed_and_what_to_do_next() -> None:
    reports = [_report("tune-a", 8, [(8, 8), (8, 8)]), _report("full-c", 12, [(12, 12), (12, 12)])]
    text = summarize(reports, decoded=25, cache_items=3, joader_s=2.0, plain_s=5.0, data=Path("/d"))
    assert "tune-a: 2 epochs of 8 images, every image once per epoch" in text
    assert "the jobs read 40 images; joaderd decoded 25 (1.60 images read per decode)" in text
    assert "2.0 s with joaderd, 5.0 s with plain DataLoaders" in text and "2.50x" in text
    assert 'JoaderDataset("photos", root="/d", image_size=224)' in text and "examples/" in text


def test_an_epoch_with_a_repeat_or_a_gap_is_called_out() -> None:
    twice = _report("tune-a", 8, [(8, 7)])  # 8 received, one of them twice
    short = _report("tune-b", 8, [(7, 7)])
    for report in (twice, short):
        assert not report.exact
        assert "NOT exactly once" in summarize([report], 8, 2, 1.0, None, Path("/d"))


def test_the_demo_runs_and_ends_with_its_summary(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "joader.client.tools.demo", "--data", str(tmp_path / "data"), "--items", "96",
         "--epochs", "1"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("demo: 3 training jobs, 1 epoch each")
    assert "on purpose" in out  # why the cache is a quarter of the data
    for name, items in (("tune-a", 64), ("tune-b", 64), ("full-c", 96)):
        assert f"{name}: 1 epoch of {items} images, every image once per epoch" in out
    assert "this run: the jobs read 224 images; joaderd decoded" in out
    assert "with plain DataLoaders" in out and "next: in your training script" in out
    runtime = Path(re.search(r"starting joaderd at unix:(\S+)/joaderd.sock", out)[1])
    assert not runtime.exists()  # its socket, ready file and the jobs' reports went with it
