"""Batches in a DataLoader worker's shared memory, and a full /dev/shm named with its fix.

A worker that collates a batch (torch's default collate, or `batched=True` with a transform)
makes it in shared memory so the training process can take it without a copy. When /dev/shm is
full, torch says only ENOSPC; these raise `SharedMemoryFullError`, which names the space left and
what to change.
"""

from __future__ import annotations

import errno
from typing import Any

import numpy as np
import torch

from joader.cache.arena import DEFAULT_SHM_DIR, format_size, shm_space
from joader.errors import SharedMemoryFullError
from joader.proto import DTYPES

_TORCH_DTYPES = {np.dtype(name): torch.from_numpy(np.empty(0, np.dtype(name))).dtype for name in DTYPES}


def shared_batch_tensor(shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
    """An uninitialized batch tensor in shared memory (no copy of its garbage, unlike
    `share_memory_()`), for a DataLoader worker to hand to the training process. Raises
    `SharedMemoryFullError` when /dev/shm cannot hold it."""
    torch_dtype = _TORCH_DTYPES[dtype]
    nbytes = int(np.prod(shape)) * dtype.itemsize
    try:
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # what torch's own collate uses
        if new_shared is None:  # not in this torch: a shared copy of an empty tensor
            return torch.empty(shape, dtype=torch_dtype).share_memory_()
        # torch's stubs want a stride; without one set_ makes the tensor contiguous, as wanted
        return torch.empty(0, dtype=torch_dtype).set_(new_shared(nbytes), 0, shape)  # type: ignore[call-overload]
    except (OSError, RuntimeError) as error:
        full = shm_full_error(error, nbytes)
        if full is None:
            raise
        raise full from error


def shm_full_error(error: BaseException, nbytes: int) -> SharedMemoryFullError | None:
    """The error to raise instead of `error` if it says /dev/shm is full, else None.

    NOTE [ torch's words for a full /dev/shm ]
    torch reports a full /dev/shm as RuntimeError("unable to allocate shared memory(shm) for
    file </torch_...>: No space left on device (28)"), with no hint of the fix: this error
    names the space left and what to change."""
    if getattr(error, "errno", None) != errno.ENOSPC and "No space left on device" not in str(error):
        return None
    return SharedMemoryFullError(
        f"a DataLoader worker cannot allocate a batch of {format_size(nbytes)} in shared memory: "
        f"{DEFAULT_SHM_DIR} is full ({shm_space()}). Free space in {DEFAULT_SHM_DIR} (`df -h "
        f"{DEFAULT_SHM_DIR}`; files of dead jobs there), in Docker raise --shm-size (e.g. "
        "--shm-size=2g), or lower the batch size or num_workers; batched=True without a transform "
        "hands batches over without shared memory")


def guard_collate(fetcher: Any) -> None:
    """Makes the collate of a DataLoader worker's fetcher raise `SharedMemoryFullError` for a
    full /dev/shm: torch's default collate makes each batch in shared memory there, and failed
    with torch's bare ENOSPC. Wrapped once per worker; any other error passes unchanged."""
    collate = getattr(fetcher, "collate_fn", None)
    if collate is None or getattr(collate, "joader_shm_guard", False):
        return

    def collate_in_shared_memory(batch: Any) -> Any:
        try:
            return collate(batch)
        except (OSError, RuntimeError) as error:
            full = shm_full_error(error, _nbytes(batch))
            if full is None:
                raise
            raise full from error

    collate_in_shared_memory.joader_shm_guard = True  # type: ignore[attr-defined]
    fetcher.collate_fn = collate_in_shared_memory


def _nbytes(batch: Any) -> int:
    """Bytes of the tensors in a list of samples (tuples of tensors and labels)."""
    total = 0
    for sample in batch if isinstance(batch, list) else [batch]:
        for part in sample if isinstance(sample, tuple | list) else (sample,):
            if isinstance(part, torch.Tensor):
                total += part.nbytes
    return total
