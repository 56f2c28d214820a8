"""The item cache and the decode pool's quarantine: a FAILED item whose file the pool holds in
quarantine (it hung or crashed a worker twice, unchanged since) is not asked for again, however
long ago it failed; a corrupt file is retried after retry_failed_s as before; a lifted one is
retried."""

from __future__ import annotations

import pytest

from joader.server.books.item_cache import ItemCache
from joader.server.books.records import ItemState, Source
from tests.unit.server.books.test_item_cache import LISTING, Pool, Stage

pytestmark = pytest.mark.timeout(30)

HANGS, CORRUPT = 3, 4


class QuarantiningPool(Pool):
    def __init__(self) -> None:
        super().__init__(probes=False)
        self.quarantined = {HANGS}

    def is_quarantined(self, source_index: int, item_id: int) -> bool:
        return item_id in self.quarantined


def test_a_quarantined_file_is_not_asked_for_again_until_the_pool_lifts_it() -> None:
    now = [0.0]
    cache = ItemCache(1 << 20, retry_failed_s=0.0, clock=lambda: now[0])
    source = Source("demo", LISTING, Stage(), 0, seed=1)
    pool = QuarantiningPool()
    for seq, item_id in enumerate((HANGS, CORRUPT)):
        cache.want(source, item_id, seq, consumed=False, due_s=float(seq))
    cache.dispatch(pool, 4, lambda source: 0)
    for key, _item_id, _offset, _capacity in pool.tasks:
        cache.file_result(key, False, "it failed", 0.001, lambda item: 0)
    pool.tasks.clear()
    now[0] = 100.0  # long past retry_failed_s: the next epoch picks both again
    hangs = cache.want(source, HANGS, 2, consumed=False, due_s=2.0)
    corrupt = cache.want(source, CORRUPT, 3, consumed=False, due_s=3.0)
    assert hangs.state is ItemState.FAILED and corrupt.state is ItemState.WAITING
    assert not cache.retry_due(hangs, 4.0)
    cache.dispatch(pool, 4, lambda source: 0)
    assert [item_id for _, item_id, _, _ in pool.tasks] == [CORRUPT]  # the hanging file is not decoded
    assert cache.lookups.failed == 1
    pool.quarantined.clear()  # its file changed on disk
    assert cache.retry_due(hangs, 5.0) and hangs.state is ItemState.WAITING
    cache.check_invariants()
