"""The decode pool's quarantine books (joader.server.pool.quarantine): stamped at once, restamped
every period (a bounded number per period, longest unchecked first), lifted when the stamp
changes; the clock is the test's."""

from __future__ import annotations

import pytest

from joader.server.pool.quarantine import Quarantine

pytestmark = pytest.mark.timeout(30)


def test_a_new_file_is_stamped_at_once_and_lifted_only_when_its_stamp_changes() -> None:
    books = Quarantine(period_s=2.0)
    books.add((0, 7), "/d/a.jpg", "hangs", now=10.0)
    assert (0, 7) in books and books.unstamped == 1 and books.reason((0, 7)) == "hangs"
    (due,) = books.due(10.0)
    assert due == ((0, 7), 1, "/d/a.jpg")
    assert books.stamped((0, 7), 1, (1, 2, 300, 5)) is None and books.unstamped == 0
    assert books.due(11.0) == []  # checked a second ago
    assert books.due(12.0) == [due]
    assert books.stamped((0, 7), 1, (1, 2, 300, 5)) is None and (0, 7) in books  # unchanged
    assert books.due(14.0) == [due]
    lifted = books.stamped((0, 7), 1, (1, 2, 310, 9))  # rewritten
    assert lifted is not None and lifted.path == "/d/a.jpg"
    assert (0, 7) not in books and books.lifted == 1


def test_a_file_that_cannot_be_stat_ed_stays_until_it_appears() -> None:
    books = Quarantine(period_s=1.0)
    books.add((0, 1), "/gone.jpg", "hangs", now=0.0)
    books.due(0.0)
    books.stamped((0, 1), 1, None)
    books.due(1.0)
    assert books.stamped((0, 1), 1, None) is None and (0, 1) in books
    books.due(2.0)
    assert books.stamped((0, 1), 1, (1, 1, 10, 10)) is not None


def test_checks_per_period_are_bounded_and_go_round() -> None:
    books = Quarantine(period_s=1.0, max_checks=2)
    for item_id in range(5):
        books.add((0, item_id), f"/{item_id}", "hangs", now=0.0)
    seen: list[int] = []
    now = 0.0
    for _ in range(3):  # the five new ones: stamped within three calls, two at a time
        for key, generation, _ in books.due(now):
            books.stamped(key, generation, (0, 0, 1, 1))
            seen.append(key[1])
    assert sorted(seen) == [0, 1, 2, 3, 4] and books.unstamped == 0
    assert books.due(0.5) == []
    first = [key[1] for key, _, _ in books.due(1.5)]
    second = [key[1] for key, _, _ in books.due(1.5)]
    assert len(first) == 2 and len(second) == 2 and not set(first) & set(second)


def test_a_stamp_of_an_earlier_quarantine_is_ignored() -> None:
    books = Quarantine()
    books.add((0, 3), "/x", "hangs", now=0.0)
    ((key, old, _),) = books.due(0.0)
    books.add((0, 3), "/x", "hangs again", now=1.0)  # quarantined again meanwhile
    assert books.stamped(key, old, (9, 9, 9, 9)) is None and books.unstamped == 1
    ((_, new, _),) = books.due(1.0)
    assert new != old and books.stamped(key, new, (1, 1, 1, 1)) is None and books.unstamped == 0
