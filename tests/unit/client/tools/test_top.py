"""User text in `joader top` and `joader status` is shown as written, never as markup or as
terminal control: real frames rendered from a status snapshot (docs/status.md) into a string.

A job named `exp[/data/imagenet]` made `joader top` exit with rich's MarkupError for everyone
on the host, and `resnet50[lr=0.1]` showed as `resnet50`; an ESC in a name or a failed file's
path reached the terminal as an escape sequence.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from joader.client.tools import top
from joader.client.tools.cli import format_status, printable
from joader.client.tools.top import render

pytestmark = pytest.mark.timeout(60)

NAMES = ("exp[/data/imagenet]", "resnet50[lr=0.1]", "[bold]loud", "a[/x]b", "]odd[", "[red]x[/red]")


def _job(job_id: str, name: str, delivered: int) -> dict[str, Any]:
    return {
        "job_id": job_id, "name": name, "source": f"src[{job_id}]", "num_items": 100, "ranks_attached": 1,
        "world_size": 1, "epoch": 1, "epoch_delivered": delivered, "epoch_items": 100,
        "items_delivered": delivered, "items_shared": 0, "samples_per_s": 12.5, "stall": {"fraction": 0.1},
    }  # fmt: skip


def _snapshot(names: tuple[str, ...], delivered: int) -> dict[str, Any]:
    return {
        "address": "unix:/run/joader[1]/joaderd.sock", "pid": 1234, "uptime_s": 60.0,
        "workers": {"alive": 2, "configured": 2, "busy": 1, "replaced": 0, "mode": "fixed",
                    "resizes": ["[bold]2 -> 3 workers[/bold]"]},
        "sources": [{"name": "imagenet[train]", "num_items": 100, "num_classes": 3, "kind": "list",
                     "stage": "center-crop[224]", "num_jobs": len(names), "root": "/data/[/x]/train.tsv"}],
        "jobs": [_job(f"j{k}", name, delivered) for k, name in enumerate(names)],
        "sharing_pairs": [{"name_a": names[0], "name_b": names[1], "rounds": 5, "rate": 0.5, "bound": 0.6,
                           "live": True}],
        "cache": {"used_bytes": 1 << 20, "capacity_bytes": 4 << 20, "items": 10, "pinned_items": 2,
                  "evictions": 0, "hit_rate": 0.5,
                  "lookups": {"hits": 5, "joined_decode": 0, "misses": 5, "failed": 0},
                  "lookahead": {"hits": 0, "misses": 0}},
        "decodes": {"in_flight": 1, "failures": 1, "retried": 0, "cancelled": 0, "decode_s": 1.0},
        "items_decoded": 10, "items_delivered": delivered * len(names), "items_failed": 1,
        "sharing": {"within_epoch": 1.0, "cross_epoch_reuse": 0.0},
        "failed": [{"source": "imagenet[train]", "path": "n01/[bold]x\x1b[2J.jpg",
                    "reason": "cannot identify image [/data/x]; check the file"}],
    }  # fmt: skip


def _frame(names: tuple[str, ...]) -> str:
    before, now = _snapshot(names, 10), _snapshot(names, 30)
    out = io.StringIO()
    Console(file=out, width=240, color_system=None, force_terminal=False).print(render(now, before, 1.0, [50.0, 30.0]))
    return out.getvalue()


def test_top_shows_job_names_as_written() -> None:
    frame = _frame(NAMES)
    for name in NAMES:
        assert name in frame, (name, frame)
    assert "unix:/run/joader[1]/joaderd.sock" in frame and "[bold]2 -> 3 workers[/bold]" in frame
    assert "20" in frame  # the rate: (30 - 10) items over one second


@pytest.mark.parametrize("name", NAMES)
def test_top_renders_a_lone_bracketed_name(name: str) -> None:
    """One job alone: the name is the whole cell, where a markup parser fails first."""
    assert name in _frame((name, "other"))


def test_top_and_status_never_pass_terminal_controls() -> None:
    names = ("evil\x1b]0;owned\x07name", "two\nlines")
    frame = _frame(names)
    status = format_status(_snapshot(names, 30))
    for shown in (frame, status):
        assert "\x1b" not in shown and "\x07" not in shown
        assert "evil\\x1b]0;owned" in shown and "two\\x0alines" in shown
    assert "n01/[bold]x\\x1b[2J.jpg" in status


def test_status_shows_every_user_string_as_written() -> None:
    status = format_status(_snapshot(NAMES, 30))
    for text in ("imagenet[train]", "center-crop[224]", "/data/[/x]/train.tsv", "exp[/data/imagenet]",
                 "src[j0]", "cannot identify image [/data/x]; check the file", "unix:/run/joader[1]/joaderd.sock"):
        assert text in status, (text, status)


def test_printable_keeps_text_and_escapes_controls() -> None:
    assert printable("résumé [bold] 日本") == "résumé [bold] 日本"
    assert printable("a\tb\x00c\x7fd\x85") == "a\\x09b\\x00c\\x7fd\\x85"


def test_status_shows_the_idle_exit_and_how_long_without_a_job() -> None:
    snapshot = {**_snapshot(NAMES, 30), "jobs": [], "sharing_pairs": [], "idle_exit_s": 600.0, "idle_s": 42.4}
    status = format_status(snapshot)
    assert "exits after 600 s with no job (--idle-exit-s)" in status
    assert "no jobs for 42 s" in status
    plain = format_status({**_snapshot(NAMES, 30), "idle_exit_s": 0.0, "idle_s": None})
    assert "--idle-exit-s" not in plain


def test_status_says_why_an_auto_cache_has_its_size() -> None:
    reason = "the whole prepared dataset (1.9 MiB for 160 items, plus 1/16)"
    auto = format_status({**_snapshot(NAMES, 30),
                          "cache_sizing": {"mode": "auto", "reason": reason, "dataset_bytes": 1966080}})
    assert f"sized by --cache-size auto: {reason}" in auto
    fixed = format_status({**_snapshot(NAMES, 30),
                           "cache_sizing": {"mode": "fixed", "reason": "set by --cache-size", "dataset_bytes": 1}})
    assert "sized by" not in fixed


# --- SHARED and FROM OTHERS (NOTE [ What SHARED means ] in client/tools/top.py) ---------------------


def _sharing_job(name: str, delivered: int, reused: int, shared: int, with_others: int | None) -> dict[str, Any]:
    job = {**_job(name, name, delivered), "items_reused": reused, "items_shared": shared}
    if with_others is not None:
        job["items_with_others"] = with_others
    return job


def _row(frame: str, name: str) -> list[str]:
    line = next(line for line in frame.splitlines() if f"│{name} " in line)
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_the_job_that_paid_for_four_jobs_decodes_reads_as_sharing() -> None:
    """Issue 38: four jobs, every decode served all four; the one that paid for most of them
    read "SHARED 17%" (only the copies another job had received first counted)."""
    leader = _sharing_job("leader", 1200, 200, 170, 1000)  # 1,000 images, 170 decoded for another job
    assert top.sharing(leader) == (1.0, 0.17)
    followers = [_sharing_job(f"f{k}", 1000, 0, 830 + k, 1000) for k in range(3)]
    now = {**_snapshot(NAMES, 30), "jobs": [leader, *followers]}
    out = io.StringIO()
    Console(file=out, width=200, color_system=None, force_terminal=False).print(top.render(now, None, 1.0, [1.0]))
    frame = out.getvalue()
    header = _row(frame.replace("┃", "│"), "JOB")
    assert header[6:8] == ["SHARED", "OTHERS"], header  # FROM above OTHERS
    assert _row(frame, "leader")[6:8] == ["100%", "17%"]
    assert _row(frame, "f0")[6:8] == ["100%", "83%"]


def test_a_job_that_shares_nothing_and_a_job_that_received_nothing() -> None:
    assert top.sharing(_sharing_job("alone", 500, 100, 0, 0)) == (0.0, 0.0)
    assert top.sharing(_sharing_job("new", 0, 0, 0, 0)) == (None, None)


def test_a_server_that_does_not_count_both_ways_shows_no_shared_column() -> None:
    frame = _frame(NAMES)  # its jobs have no items_with_others
    assert "OTHERS" in frame and "SHARED" not in frame
    assert top.sharing(_sharing_job("old", 100, 0, 25, None)) == (None, 0.25)


def test_status_shows_default_job_names_whole_so_trials_tell_apart() -> None:
    """Default names are command lines (issue 38): `train.py --lr 0.01 --data loop` cut at 24
    characters read the same for every trial of a bash loop."""
    names = ("train.py --lr 0.1 --data loop", "train.py --lr 0.01 --data loop")
    status = format_status(_snapshot(names, 30))
    rows = [line for line in status.splitlines() if line.startswith("train.py") and " src[" in line]
    assert [row.split(" src[")[0].rstrip() for row in rows] == list(names)
    assert len({row.index(" src[") for row in rows}) == 1  # one column width for both
    assert f"{names[0]} + {names[1]}" in status  # the sharing pair, whole too
