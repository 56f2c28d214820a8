"""Filing finished decodes: failed items skipped, reported and retried after the retry time;
images smaller than the stage counted (server/registry/filing.py, through the registry)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pyroaring import BitMap

from tests.support.registry_driver import (
    attach,
    make_registry,
    nxt,
    read_epoch,
)

pytestmark = pytest.mark.timeout(60)


def test_failed_items_are_skipped_reported_and_not_decoded_again_before_the_retry_time() -> None:
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(20)), "a", 4)
    bad = {3, 11}
    for epoch in range(2):
        order = read_epoch(registry, pool, job.job_id, token=epoch, fail=bad)
        assert sorted(order) == [i for i in range(20) if i not in bad]
    status = registry.status()
    assert status["items_failed"] == 2
    assert {f["path"] for f in status["failed"]} == {"b/003.jpg", "b/011.jpg"}
    assert status["decodes"]["requested"] - status["items_decoded"] == 2  # tried once each
    registry.remove_job(job.job_id, "test")


def test_a_failed_item_is_decoded_again_at_its_next_use_after_the_retry_time() -> None:
    """The storage was down during epoch 1: every file failed. The lookahead queued epoch 2's
    first picks then, still failed. Once the retry time has passed (the storage is back), those
    copies are decoded again when epoch 2's pass starts, not reported failed from the old
    decision (epoch 2 delivered 8 of 10)."""
    registry, pool, clock = make_registry(num_slots=8, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(10)), "a", 2)
    order = read_epoch(registry, pool, job.job_id, token=1, batch=2, fail=set(range(10)))
    assert order == [] and registry.status()["items_failed"] == 10
    stale = [e.item_id for e in job.ranks[0].queue if e.epoch == 2]
    assert stale  # queued while failed
    clock.now += registry.config.retry_failed_s + 1  # the files are back
    first = nxt(registry, job.job_id, 2, 2, [])  # epoch 2's pass starts: their decodes start at once
    registry.schedule_once()
    assert set(stale) <= {item_id for _, _, item_id, _ in pool.submitted}
    order = first.item_ids + read_epoch(registry, pool, job.job_id, token=2, batch=2)
    assert sorted(order) == list(range(10))
    status = registry.status()
    assert status["items_failed"] == 0 and status["decodes"]["retried"] == 10
    registry.remove_job(job.job_id, "test")
    assert registry.status()["cache"]["pinned_items"] == 0


def test_a_failed_copy_reached_by_a_next_after_the_retry_time_is_decoded_again() -> None:
    """The same when the retry time passes during epoch 2, before a Next reaches the copy: the
    first copy, handed out before the retry time, is skipped; the second is decoded again."""
    registry, pool, clock = make_registry(num_slots=12, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(10)), "a", 1)
    read_epoch(registry, pool, job.job_id, token=1, batch=1, fail=set(range(10)))
    assert len([e for e in job.ranks[0].queue if e.epoch == 2]) >= 2
    first = nxt(registry, job.job_id, 2, 1, [])  # before the retry time: skipped
    assert first.item_ids == [] and len(first.failed) == 1
    clock.now += registry.config.retry_failed_s + 1
    order = read_epoch(registry, pool, job.job_id, token=2, batch=1)
    assert sorted(order) == sorted(set(range(10)) - {first.failed[0][0]})


def test_a_file_that_keeps_failing_is_retried_at_most_once_per_use_and_skipped() -> None:
    """--retry-failed-s 0: every use may retry, but a copy reached by a Next is retried once,
    then reported; an epoch never loops on a broken file."""
    registry, pool, clock = make_registry(num_slots=60, lease_s=1000.0, retry_failed_s=0.0)
    job = attach(registry, "demo", BitMap(range(10)), "a", 4)
    for token in (1, 2, 3):
        clock.now += 1.0
        order = read_epoch(registry, pool, job.job_id, token=token, fail={5})
        assert sorted(order) == [i for i in range(10) if i != 5]
    assert registry.status()["decodes"]["requested"] <= 10 + 3 * 2


@pytest.mark.parametrize("upscale", [False, True])
def test_images_served_smaller_than_the_stage_are_counted_and_warned_about(
        caplog: pytest.LogCaptureFixture, upscale: bool) -> None:
    """With `upscale = false` a small image is served at its own size: counted, and the log
    names the option; with upscale (the default) none is (a stage's own shape, like max-side's
    or a capped strip's, is not "small")."""
    registry, pool, _ = make_registry()
    source = registry.source("demo")
    source.stage = SimpleNamespace(**vars(source.stage), upscale=upscale, kind="center-crop")
    job = attach(registry, "demo", BitMap(range(6)), "a", 4)
    nxt(registry, job.job_id, 1, 4, [])
    registry.schedule_once()
    with caplog.at_level("WARNING"):
        for task_id, _, item_id, _ in list(pool.submitted):
            shape = (3, 5, 7) if item_id % 2 else (3, 8, 8)  # odd items: smaller than S = 8
            registry.file_result(task_id, True, None, 0.001, shape=shape, dtype="uint8",
                                 nbytes=3 * shape[1] * shape[2])
        pool.submitted.clear()
    registry.check_invariants()
    small = registry.status()["sources"][0]["small_items"]
    if upscale:
        assert small == 0 and "smaller than" not in caplog.text
        return
    assert small == sum(1 for i in range(6) if i % 2 and i in registry.source("demo").cached_ids)
    assert small > 0 and "smaller than 8 px" in caplog.text and "--no-upscale demo to upscale" in caplog.text
