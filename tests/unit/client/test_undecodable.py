"""`len(ds)` leaves out the files known to fail to decode (`joader.client.undecodable`): set by
a reply that reports them, cleared by one that delivers them."""

from __future__ import annotations

import pickle

from joader.client.undecodable import Undecodable


def test_an_item_counts_as_undecodable_from_its_failure_until_it_is_delivered() -> None:
    known = Undecodable(25)
    assert known.count() == 0
    known.note([], range(10))  # nothing failed yet: nothing to clear
    known.note([13], [10, 11, 12])
    known.note([24, 99], [14])  # an id past the listing (the source grew since): ignored
    assert known.count() == 2
    known.note([], [15, 24])  # the file was fixed, and decoded again
    assert known.count() == 1
    known.note([13], [])  # the next epoch reports it again
    assert known.count() == 1


def test_a_pickled_copy_starts_empty_and_apart() -> None:
    known = Undecodable(5)
    known.note([1], [])
    copy = pickle.loads(pickle.dumps(known))
    assert (copy.num_items, copy.count()) == (5, 0)
    copy.note([2], [])
    assert known.count() == 1
