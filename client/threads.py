"""torch's intra-op threads in a training process that reads from joaderd (`JoaderDataset`'s
`threads` argument).

NOTE [ One intra-op thread beside joaderd ]
joaderd's decoders keep the host's cores busy; a collate or transform that runs as a
multi-threaded parallel region on busy cores is tens of times slower (OpenMP threads spin
waiting for each other). So a dataset sets one thread unless told otherwise, and says so once
per process: a CPU-bound training loop (no GPU) runs its model on these threads too.
"""

from __future__ import annotations

import logging

import torch

from joader.errors import InvalidArgumentError

# The dataset's argument, the dataset's logger (NOTE [ The dataset's logger ] in attachment.py).
logger = logging.getLogger("joader.client.dataset")

_warned = False


def set_threads(threads: int | str | None) -> None:
    """"auto": one thread; an int: that many; None: torch's setting, with a warning if more
    than one."""
    current = torch.get_num_threads()
    if threads == "auto":
        wanted = 1
    elif threads is None:
        if current > 1:
            logger.warning(
                "torch uses %d intra-op threads in this process while joaderd's decoders keep the "
                "CPUs busy: collation and transforms can run tens of times slower. Leave "
                "JoaderDataset(threads='auto') (the default), or call torch.set_num_threads(1).",
                current,
            )
        return
    elif isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1:
        wanted = threads
    else:
        raise InvalidArgumentError(f"threads must be 'auto', None or a positive int, got {threads!r}")
    if current != wanted:
        torch.set_num_threads(wanted)
        global _warned
        if not _warned:
            _warned = True
            logger.warning(
                "joader: torch.set_num_threads(%d) in this process (it was %d), because joaderd's "
                "decoders keep the cores busy; a model trained on the CPU then runs on %d thread(s). "
                "Pass JoaderDataset(threads=N) for N threads, or threads=None to keep torch's setting.",
                wanted, current, wanted)
