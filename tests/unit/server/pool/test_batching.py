"""Decode tasks in batches (server/pool/batching.py): how many tasks one message to a worker
carries, from the measured decode times."""

from __future__ import annotations

from joader.server.pool.batching import (
    MAX_TASKS_PER_SLOT,
    SLOT_S,
    STALL_FLOOR_S,
    STALL_MULTIPLE,
    TaskBatching,
    tasks_per_slot,
)


def test_one_task_per_batch_until_a_decode_was_measured() -> None:
    assert TaskBatching().tasks_per_slot == 1


def test_a_batch_is_about_a_slot_of_decoding_within_its_bounds() -> None:
    assert tasks_per_slot(SLOT_S / 10) == 10
    assert tasks_per_slot(SLOT_S * 3) == 1  # a slow decode is a batch of one, as before batching
    assert tasks_per_slot(SLOT_S / 10_000) == MAX_TASKS_PER_SLOT
    assert tasks_per_slot(0.0) == MAX_TASKS_PER_SLOT


def test_the_batch_follows_the_moving_average_of_decode_times() -> None:
    batching = TaskBatching()
    batching.add(SLOT_S / 8)
    assert batching.tasks_per_slot == 8  # the first decode sets it at once
    for _ in range(2000):  # decodes slow down to a slot each: batches of one again
        batching.add(SLOT_S)
    assert batching.tasks_per_slot == 1


def test_a_worker_is_stalled_after_50_ms_or_ten_mean_decodes() -> None:
    batching = TaskBatching()
    assert batching.stall_s == STALL_FLOOR_S  # nothing measured yet
    batching.add(0.001)
    assert batching.stall_s == STALL_FLOOR_S
    slow = TaskBatching()
    slow.add(0.5)  # photos of a large size: a task of 2 s is not a stall yet
    assert slow.stall_s == STALL_MULTIPLE * 0.5
