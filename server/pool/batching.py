"""Decode tasks in batches: how many tasks one message to a worker carries, from the decode
times the pool measures. Pure: no clock, no I/O; the pool feeds it and reads it.

NOTE [ Decode tasks in batches ]
A task went to its worker in a message of its own, two per worker ahead, and the registry kept
two decodes per worker in flight (`RegistryConfig.decodes_in_flight_per_worker`). With a decode
of a few milliseconds (a photo to 224 px) that kept the workers busy for a few microseconds of
joaderd's CPU per item. With a cheap decode (issue 37's tiny images: about 0.1 ms) the worker
sat idle most of the time while joaderd's main process spent about 200 us of CPU per decode
(one result per wake-up of the results thread, one lock, one dispatch, one message per task).

A *slot* (what the registry's limit and the pool's `tasks_per_worker` count) is now a batch:
enough tasks for about `SLOT_S` of decoding (`tasks_per_slot`), sent to a worker in one
message. A decode of 2.5 ms or more (a photo) is a batch of one, as before; a 0.1 ms decode a
batch of 50. So with cheap decodes a worker has about 2 x `SLOT_S` (10 ms) of them committed
ahead, out of the registry's earliest-due order: enough to stay busy while the results thread
gathers their results for up to 5 ms (`DecodePool.get_results`, NOTE [ Results in batches ]).
2 ms and 5 ms were within the noise of single runs of the 128k bench (162 and 159 us of main
CPU per decode); 5 ms files fewer, larger batches. Results still come one message per task
(a worker never holds one back: a result that waited in a worker that then crashed would
blame the wrong file, joader.server.pool.faults; NOTE [ One read per batch of results ] in
wire.py).
"""

from __future__ import annotations

__all__ = ["MAX_TASKS_PER_SLOT", "SLOT_S", "STALL_FLOOR_S", "STALL_MULTIPLE", "TaskBatching", "tasks_per_slot"]

SLOT_S = 0.005  # seconds of decoding one batch of tasks aims at
MAX_TASKS_PER_SLOT = 64  # tasks in one message at most (a message stays well under MAX_MESSAGE)
STALL_FLOOR_S = 0.05  # a running task older than this (and than STALL_MULTIPLE x the mean) is stalled
STALL_MULTIPLE = 10.0
_WEIGHT = 1 / 64  # of each new decode time in the moving average
_RECOMPUTE_EVERY = 16  # decodes between two computations of `tasks_per_slot`


class TaskBatching:
    """The tasks in one batch (`tasks_per_slot`): `SLOT_S` over a moving average of the decode
    times measured (`add`), at least 1 and at most `max_tasks`; 1 until a decode was measured."""

    def __init__(self, slot_s: float = SLOT_S, max_tasks: int = MAX_TASKS_PER_SLOT) -> None:
        self.slot_s = slot_s
        self.max_tasks = max_tasks
        self.mean_s: float | None = None
        self.tasks_per_slot = 1
        self._since = 0

    @property
    def stall_s(self) -> float:
        """How long a worker's running task may go on before the worker is stalled and gets no
        new task while another does not (NOTE [ A stalled worker gets no more tasks ] in
        decode_pool.py)."""
        return max(STALL_FLOOR_S, STALL_MULTIPLE * (self.mean_s or 0.0))

    def add(self, decode_s: float) -> None:
        """One decode's time, as its worker measured it (a decode that did not fit too)."""
        mean = self.mean_s
        self.mean_s = decode_s if mean is None else mean + (decode_s - mean) * _WEIGHT
        self._since += 1
        if self._since >= _RECOMPUTE_EVERY or mean is None:
            self._since = 0
            self.tasks_per_slot = tasks_per_slot(self.mean_s, self.slot_s, self.max_tasks)


def tasks_per_slot(mean_s: float, slot_s: float = SLOT_S, max_tasks: int = MAX_TASKS_PER_SLOT) -> int:
    """Tasks of `mean_s` each that make about `slot_s` of decoding, within 1..`max_tasks`."""
    if mean_s <= 0:
        return max_tasks
    return max(1, min(max_tasks, int(slot_s / mean_s)))
