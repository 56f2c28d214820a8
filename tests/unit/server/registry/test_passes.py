"""Passes: a new pass supersedes an unfinished one and starts a whole epoch; a continuation never
supersedes a newer pass (server/registry/passes.py, through the registry)."""

from __future__ import annotations

import pytest
from pyroaring import BitMap

from joader.errors import PassSupersededError
from tests.support.registry_driver import (
    attach,
    make_registry,
    nxt,
    pump,
    read_epoch,
)

pytestmark = pytest.mark.timeout(60)


def test_a_new_pass_abandons_an_unfinished_epoch_and_starts_a_whole_one() -> None:
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(30)), "a", 4)
    pump(registry, pool)
    assert not job.ranks[0].queue  # registered, not reading yet: no rounds, no decodes
    assert nxt(registry, job.job_id, 7, 4, []).item_ids == []  # nothing prepared yet
    pump(registry, pool)
    first = nxt(registry, job.job_id, 7, 4, [])
    assert first.epoch == 1 and len(first.item_ids) == 4
    order = read_epoch(registry, pool, job.job_id, token=8)  # a new pass: epoch 2, whole
    assert sorted(order) == list(range(30))
    with pytest.raises(PassSupersededError, match="newer iterator"):  # a straggler of pass 7
        nxt(registry, job.job_id, 7, 4, first.item_ids)
    late_ack = nxt(registry, job.job_id, 7, 0, first.item_ids)  # acknowledging still works
    assert not late_ack.item_ids
    registry.remove_job(job.job_id, "test")
    assert registry.status()["cache"]["pinned_items"] == 0


def test_fresh_workers_with_a_repeated_token_start_a_new_whole_epoch() -> None:
    """torch.manual_seed before each epoch gives fresh DataLoader workers the same base seed."""
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(24)), "a", 4)
    seen: list[list[int]] = []
    for epoch, pids in enumerate([(101, 102), (201, 202), (301, 302)], start=1):
        order: list[int] = []
        acks = {0: [], 1: []}
        done = {0: False, 1: False}
        while not all(done.values()):
            pump(registry, pool)
            for worker in (0, 1):
                if done[worker]:
                    continue
                batch = nxt(registry, job.job_id, 77, 3, acks[worker], worker_id=worker, pid=pids[worker])
                assert batch.epoch == epoch
                acks[worker] = batch.item_ids
                order += batch.item_ids
                done[worker] = batch.end_of_epoch
        seen.append(order)
    assert [sorted(o) for o in seen] == [list(range(24))] * 3
    # A worker of an earlier pass that still asks gets a clear error, not an empty epoch.
    with pytest.raises(PassSupersededError):
        nxt(registry, job.job_id, 77, 3, [], worker_id=1, pid=202)


def test_a_continuation_never_supersedes_a_newer_pass() -> None:
    """A straggling request of a pass the restart interrupted (epoch 1) after the rank's new
    pass (epoch 2) started on the restarted joaderd: it is the superseded one."""
    registry, pool, _ = make_registry(num_slots=40)
    job = attach(registry, "demo", BitMap(range(20)), "a", 4, restart_report=(1, BitMap(range(20))))
    pump(registry, pool)
    assert nxt(registry, job.job_id, 5, 4, [], continue_epoch=0).epoch == 2
    with pytest.raises(PassSupersededError):
        nxt(registry, job.job_id, 4, 4, [], continue_epoch=1)
    assert sorted(read_epoch(registry, pool, job.job_id, 5)) == list(range(20))
