"""BatchPool: a buffer goes back only when no tensor, view or array of it remains."""

from __future__ import annotations

import gc

import torch

from joader.client.batchpool import BatchPool


def test_a_buffer_returns_only_after_its_last_view_is_gone_and_is_then_reused() -> None:
    pool = BatchPool(4 * 16)
    batch = torch.from_numpy(pool.take().reshape(4, 16))
    batch.fill_(7)
    view = batch[1:3]
    del batch
    gc.collect()
    assert pool.idle == 0  # the view still holds the buffer: it must not be reused
    assert int(view.sum()) == 7 * 32
    other = torch.from_numpy(pool.take())  # so a new take gets a new mapping
    assert pool.created == 2
    other.fill_(1)
    assert int(view.sum()) == 7 * 32  # untouched by the other batch
    del view
    assert pool.idle == 1
    again = pool.take()
    assert pool.created == 2 and pool.idle == 0  # reused, not created
    del again, other
    assert pool.idle == 2


def test_the_pool_keeps_at_most_keep_idle_buffers() -> None:
    pool = BatchPool(64, keep=2)
    arrays = [pool.take() for _ in range(5)]
    del arrays
    assert pool.idle == 2 and pool.created == 5
