"""Batches in shared memory, and a full /dev/shm named with its fix (the real full /dev/shm
runs in tests/integration/test_client_ends.py, with the allocation made to fail there)."""

from __future__ import annotations

import errno

import numpy as np
import pytest
import torch

from joader.client.shm_batches import guard_collate, shared_batch_tensor, shm_full_error
from joader.errors import SharedMemoryFullError


def test_a_shared_batch_tensor_has_the_shape_and_dtype_asked_and_lives_in_shared_memory() -> None:
    for dtype in (np.dtype("uint8"), np.dtype("float32"), np.dtype("int64")):
        tensor = shared_batch_tensor((4, 3, 2), dtype)
        assert tensor.shape == (4, 3, 2) and tensor.dtype == torch.from_numpy(np.empty(0, dtype)).dtype
        assert tensor.is_shared()


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("unable to allocate shared memory(shm) for file </torch_1>: "
                                                "No space left on device (28)")])
def test_torchs_words_for_a_full_dev_shm_become_an_error_that_names_the_fix(error: BaseException) -> None:
    full = shm_full_error(error, 3 * 2**20)
    assert isinstance(full, SharedMemoryFullError) and isinstance(full, OSError)
    assert "3.0 MiB" in str(full) or "3 MiB" in str(full), str(full)
    assert "--shm-size" in str(full) and "is full" in str(full)


def test_other_errors_are_not_taken_for_a_full_dev_shm() -> None:
    assert shm_full_error(RuntimeError("CUDA error"), 10) is None
    assert shm_full_error(OSError(errno.EACCES, "Permission denied"), 10) is None


def test_a_guarded_collate_raises_the_named_error_and_passes_other_errors_unchanged() -> None:
    def collate(batch: list) -> list:
        if batch == ["full"]:
            raise RuntimeError("No space left on device (28)")
        if batch == ["other"]:
            raise ValueError("not mine")
        return batch

    fetcher = type("Fetcher", (), {"collate_fn": staticmethod(collate)})()
    guard_collate(fetcher)
    guarded = fetcher.collate_fn
    guard_collate(fetcher)  # once per worker: a second call wraps nothing more
    assert fetcher.collate_fn is guarded
    assert guarded([1, 2]) == [1, 2]
    with pytest.raises(SharedMemoryFullError):
        guarded(["full"])
    with pytest.raises(ValueError, match="not mine"):
        guarded(["other"])
