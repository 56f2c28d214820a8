"""The scheduler (server/scheduling/scheduler.py): DSA rounds dealt to the ranks' queues, epoch shares and
padding, pinning within a rank's share, and how far ahead it prepares. Driven directly, without
a registry: a job table attaches the jobs, the test sets what the registry would."""

from __future__ import annotations

import pytest
from pyroaring import BitMap

from joader.server.books.records import Job
from tests.support.job_books import books

pytestmark = pytest.mark.timeout(60)


def _reading(job: Job, capacity: int = 64, share: int = 1000) -> Job:
    """What the registry sets once the job's ranks all attached and one asked for items."""
    for rank in job.ranks[1:]:
        rank.attached = True
    job.reading = True
    job.queue_capacity = capacity
    job.cache_share = share
    return job


def _run_rounds(scheduler, source, jobs: dict[str, Job], limit: int = 1000) -> int:  # type: ignore[no-untyped-def]
    rounds = 0
    while rounds < limit and scheduler.run_round(source, jobs):
        rounds += 1
    return rounds


def _epoch(job: Job, rank: int, epoch: int) -> list[int]:
    return [entry.item_id for entry in job.ranks[rank].queue if entry.epoch == epoch]


@pytest.mark.parametrize(("drop_last", "each"), [(False, 4), (True, 3)])
def test_an_epoch_is_dealt_evenly_to_the_ranks_with_padding_or_drop_last(drop_last: bool, each: int) -> None:
    """10 items, 3 ranks: ceil(10 / 3) = 4 each, the 2 missing copies padded from the epoch's
    first picks (as DistributedSampler repeats its first indices); under drop_last 3 each, the
    pick nobody needs dropped."""
    table, scheduler, source, _ = books()
    job, _ = table.attach(source, BitMap(range(10)), "ddp", 4, world_size=3, drop_last=drop_last, seed=5)
    _reading(job)
    job.ranks[0].claimed_epoch = 0  # no pass yet: only the first epoch is prepared
    _run_rounds(scheduler, source, table.jobs)
    parts = [_epoch(job, r, 1) for r in range(3)]
    assert [len(p) for p in parts] == [each] * 3
    delivered = [i for part in parts for i in part]
    if drop_last:
        assert len(set(delivered)) == 9
    else:
        assert set(delivered) == set(range(10))
        assert len(delivered) - len(set(delivered)) == 2  # two padding copies
        firsts = [parts[r][0] for r in range(3)]  # the epoch's first picks, one per rank
        assert {i for i in delivered if delivered.count(i) > 1} <= set(firsts)
    assert job.shares[1].complete


def test_a_fresh_epoch_is_dealt_round_robin() -> None:
    table, scheduler, source, _ = books()
    job, _ = table.attach(source, BitMap(range(12)), "ddp", 4, world_size=2, seed=5)
    _reading(job)
    _run_rounds(scheduler, source, table.jobs)
    share = job.shares[1]
    assert share.target == [6, 6] and share.assigned == [6, 6]
    # picks alternate: rank 0 got picks 0, 2, 4, ... of the sampler's order
    assert len(_epoch(job, 0, 1)) == len(_epoch(job, 1, 1)) == 6


def test_the_sampler_prepares_one_epoch_ahead_of_the_newest_pass_at_most() -> None:
    """A dataset smaller than the queue: without a bound the sampler ran dozens of epochs ahead
    of its reader."""
    table, scheduler, source, _ = books()
    job, _ = table.attach(source, BitMap(range(6)), "tiny", 64, seed=5)
    _reading(job)
    _run_rounds(scheduler, source, table.jobs)
    assert {e.epoch for e in job.ranks[0].queue} == {1}  # no pass yet: epoch 1 only
    job.ranks[0].claimed_epoch = 1  # a pass reads epoch 1: epoch 2 may be prepared
    _run_rounds(scheduler, source, table.jobs)
    assert sorted(_epoch(job, 0, 2)) == list(range(6))
    assert {e.epoch for e in job.ranks[0].queue} == {1, 2}
    assert not scheduler.run_round(source, table.jobs)


def test_a_job_takes_part_only_while_it_reads_with_every_rank_attached_and_its_queue_low() -> None:
    table, scheduler, source, _ = books()
    job, _ = table.attach(source, BitMap(range(40)), "a", 4, world_size=2, seed=5)
    assert not scheduler.run_round(source, table.jobs)  # not reading
    job.reading = True
    job.queue_capacity, job.cache_share = 4, 100
    assert not scheduler.run_round(source, table.jobs)  # rank 1 not attached
    job.ranks[1].attached = True
    rounds = _run_rounds(scheduler, source, table.jobs)
    # each rank fills to its capacity (4) and the round that tips the second over stops it
    assert [len(r.queue) for r in job.ranks] == [4, 4] and rounds == 8


def test_a_rank_pins_the_head_of_its_queue_within_its_share_only() -> None:
    """Queued is not pinned: a rank pins (and asks decodes for) the head of its queue while its
    pinned entries plus its unacknowledged copies stay within its share; a smaller share
    unpins the newest pinned entries."""
    table, scheduler, source, _ = books()
    job, rank = table.attach(source, BitMap(range(40)), "a", 4, seed=5)
    _reading(job, capacity=20, share=6)
    _run_rounds(scheduler, source, table.jobs)
    assert len(rank.queue) == 20 and rank.pinned == 6
    rank.handed_out = 2  # two copies out, unacknowledged (as a Next would leave them)
    scheduler.pin_ahead(job, rank)
    assert rank.pinned == 4
    job.cache_share = 3  # jobs arrived: the share shrank
    scheduler.pin_ahead(job, rank)
    assert rank.pinned == 1
    rank.handed_out = 0
    job.cache_share = 100
    scheduler.pin_ahead(job, rank)
    assert rank.pinned == 20  # the whole queue, in order
    assert [scheduler._cache.items[e.key].pins for e in rank.queue] == [1] * 20


def test_jobs_on_one_source_share_rounds_and_their_pairs_are_counted() -> None:
    table, scheduler, source, _ = books()
    a, _ = table.attach(source, BitMap(range(20)), "a", 4, seed=5)
    b, _ = table.attach(source, BitMap(range(20)), "b", 4, seed=6)
    for job in (a, b):
        _reading(job, capacity=8)
    _run_rounds(scheduler, source, table.jobs)
    rounds, shared = source.pair_rounds[tuple(sorted((a.job_id, b.job_id)))]
    assert rounds >= 8 and shared == rounds  # identical datasets: every round gives both the same item
    assert _epoch(a, 0, 1) == _epoch(b, 0, 1)


def test_an_independent_job_takes_part_but_shares_no_round_and_is_in_no_pair() -> None:
    """order="independent": the job takes part in rounds by the same rule (its queue fills),
    but it draws alone (its own stream, outside the chain), so no pair count names it, even
    in rounds where its pick happens to equal another job's; the shared pair still counts."""
    table, scheduler, source, _ = books()
    a, _ = table.attach(source, BitMap(range(20)), "a", 4, seed=5)
    b, _ = table.attach(source, BitMap(range(20)), "b", 4, seed=6)
    solo, _ = table.attach(source, BitMap(range(20)), "solo", 4, seed=7, order="independent")
    assert source.sampler.independent(solo.job_id) and not source.sampler.independent(a.job_id)
    for job in (a, b, solo):
        _reading(job, capacity=8)
    _run_rounds(scheduler, source, table.jobs)
    assert len(_epoch(solo, 0, 1)) == len(_epoch(a, 0, 1)) >= 8  # it took part in every round
    assert list(source.pair_rounds) == [tuple(sorted((a.job_id, b.job_id)))]
    rounds, shared = source.pair_rounds[tuple(sorted((a.job_id, b.job_id)))]
    assert rounds >= 8 and shared == rounds
    # its order is its own stream's: the same seed alone on a fresh source gives the same picks
    table2, scheduler2, source2, _ = books()
    alone, _ = table2.attach(source2, BitMap(range(20)), "solo", 4, seed=7, order="independent")
    _reading(alone, capacity=8)
    _run_rounds(scheduler2, source2, table2.jobs)
    assert _epoch(alone, 0, 1) == _epoch(solo, 0, 1)


def test_a_resumed_independent_job_stays_independent() -> None:
    table, scheduler, source, _ = books()
    job, _ = table.attach(source, BitMap(range(12)), "a", 4, seed=5, order="independent")
    _reading(job)
    scheduler.start_resumed(job, 2, [BitMap([0, 1, 2])])
    assert source.sampler.independent(job.job_id)
    _run_rounds(scheduler, source, table.jobs)
    assert sorted(_epoch(job, 0, 2)) == list(range(3, 12))


def test_a_resumed_epoch_is_dealt_without_what_was_consumed() -> None:
    table, scheduler, source, _ = books()
    job, rank = table.attach(source, BitMap(range(12)), "a", 4, world_size=2, seed=5)
    _reading(job)
    scheduler.start_resumed(job, 3, [BitMap([0, 1, 2]), BitMap([3])])
    assert job.sampler_epoch == 3 and job.shares[3].target == [6 - 3, 6 - 1]
    _run_rounds(scheduler, source, table.jobs)
    got = _epoch(job, 0, 3) + _epoch(job, 1, 3)
    assert sorted(got) == list(range(4, 12)) and len(_epoch(job, 0, 3)) == 3


def _measured(job: Job, clock, items_per_s: float) -> None:  # type: ignore[no-untyped-def]
    """The job's delivery rate as its RateMeter would have measured it up to `clock.now`."""
    job.rate.add(clock.now - 2.0, 0)
    job.rate.add(clock.now, int(items_per_s * 2.0))


def _decoding(scheduler, clock, per_s: float) -> None:  # type: ignore[no-untyped-def]
    meter = scheduler._cache.decode_rate
    meter.add(clock.now - 2.0, 0)
    meter.add(clock.now, int(per_s * 2.0))


def _lagging_pair(lag: int, *, plan_horizon: int, rates: bool = True):  # type: ignore[no-untyped-def]
    """Two jobs of equal speed (100 items/s): `a` below its capacity (it wants a round), `b`
    `lag` items behind it (a longer queue); the cache turns over at 100 decodes/s."""
    table, scheduler, source, clock = books(num_items=400)
    a, ra = table.attach(source, BitMap(range(400)), "a", 4, seed=5)
    b, rb = table.attach(source, BitMap(range(400)), "b", 4, seed=6)
    for job in (a, b):
        _reading(job, capacity=4)
        job.plan_horizon = plan_horizon
    scheduler.run_round(source, table.jobs)  # both queues get one entry
    while len(rb.queue) < 1 + lag:  # b's own rounds: its queue grows past a's
        b.reading, a.reading = True, False
        b.queue_capacity = lag + 2
        scheduler.run_round(source, table.jobs)
        b.queue_capacity, a.reading = 4, True
    if rates:
        for job in (a, b):
            _measured(job, clock, 100.0)
        _decoding(scheduler, clock, 100.0)
    return table, scheduler, source, (a, ra), (b, rb)


def test_a_lagging_job_takes_part_while_the_cache_can_bridge_its_lag() -> None:
    """NOTE [ Planning a lagging job ahead ]: `b` is 20 items (0.2 s) behind `a`. With a
    horizon of 40 items the cache keeps an item 0.4 s at 100 decodes/s: `b` takes the round's
    pick with `a` (the same item: identical datasets). With a horizon of 10 items it is past
    the bound and sits out, as it would beyond twice its capacity under the old rule."""
    table, scheduler, source, (a, ra), (b, rb) = _lagging_pair(20, plan_horizon=40)
    before = len(rb.queue)
    assert scheduler.run_round(source, table.jobs)
    assert len(rb.queue) == before + 1 and rb.queue[-1].item_id == ra.queue[-1].item_id
    table, scheduler, source, (a, ra), (b, rb) = _lagging_pair(20, plan_horizon=10)
    before = len(rb.queue)
    assert scheduler.run_round(source, table.jobs)
    assert len(rb.queue) == before


def test_a_lagging_job_sits_out_beyond_what_the_cache_keeps_or_with_rates_unknown() -> None:
    """The wait rule: 60 items behind at 100 items/s is a wait of 0.6 s, more than the 0.5 s
    the cache keeps its 80-item horizon at 160 decodes/s: within the horizon's items but not
    its time, `b` sits out. Before rates are measured, only the old rule counts."""
    table, scheduler, source, (a, ra), (b, rb) = _lagging_pair(60, plan_horizon=80)
    scheduler._cache.decode_rate = type(scheduler._cache.decode_rate)()
    _decoding(scheduler, table._clock, 160.0)  # keeps 80 items 0.5 s
    before = len(rb.queue)
    assert scheduler.run_round(source, table.jobs)
    assert len(rb.queue) == before
    table, scheduler, source, (a, ra), (b, rb) = _lagging_pair(20, plan_horizon=40, rates=False)
    before = len(rb.queue)
    assert scheduler.run_round(source, table.jobs)
    assert len(rb.queue) == before


def _world(seed: int, monkeypatch: pytest.MonkeyPatch, ranks_of_c: int = 2):  # type: ignore[no-untyped-def]
    """Three jobs (two datasets overlapping by half, the third of `ranks_of_c` ranks) with ids
    that do not depend on the run, so two worlds built alike sample alike."""
    counter = iter(range(1000))
    monkeypatch.setattr("joader.server.registry.jobs.secrets.token_hex", lambda n: f"{next(counter):08x}")
    table, scheduler, source, clock = books(num_items=90, slots=400, max_jobs=8)
    jobs = [
        table.attach(source, BitMap(range(0, 60)), "a", 4, seed=seed)[0],
        table.attach(source, BitMap(range(30, 90)), "b", 4, seed=seed + 1)[0],
        table.attach(source, BitMap(range(0, 90, 2)), "c", 4, world_size=ranks_of_c, seed=seed + 2)[0],
    ]
    for capacity, job in zip((6, 9, 4), jobs, strict=True):
        _reading(job, capacity=capacity, share=12)
    return table, scheduler, source, clock, jobs


def _snapshot(jobs: list[Job], source) -> list[object]:  # type: ignore[no-untyped-def]
    return [
        (job.sampler_epoch, [([(e.epoch, e.item_id) for e in rank.queue], rank.pinned) for rank in job.ranks],
         sorted(source.sampler.remaining(job.job_id)))
        for job in jobs
    ]


@pytest.mark.parametrize("ranks_of_c", [2, 1])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_rounds_in_batches_deal_what_single_rounds_deal(seed: int, ranks_of_c: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Rounds in batches ]: a turn's batches (`max_rounds`) leave every queue, pin,
    remaining set and epoch as the same turn of single rounds does, through epoch ends,
    padding and reads of random sizes, for 3 jobs on overlapping datasets (the third of 2
    ranks: batches that ask `_goes_on` after each round; or of 1: batches drawn at once,
    `_rounds_ahead`)."""
    single = _world(seed, monkeypatch, ranks_of_c)
    batched = _world(seed, monkeypatch, ranks_of_c)
    reads = __import__("random").Random(seed)
    batches_larger_than_one = 0
    for _turn in range(300):
        for (_, scheduler, source, clock, jobs), batch in ((single, False), (batched, True)):
            clock.now += 0.01
            budget = 64
            while budget > 0:
                ran = scheduler.run_round(source, {j.job_id: j for j in jobs},
                                          max_rounds=budget if batch else 1)
                if not ran:
                    break
                batches_larger_than_one += batch and ran > 1
                budget -= ran
        assert _snapshot(batched[4], batched[2]) == _snapshot(single[4], single[2])
        takes = [(j, r, reads.randrange(0, 7)) for j, job in enumerate(single[4]) for r in range(job.world_size)]
        for _, scheduler, _, _, jobs in (single, batched):
            for j, r, take in takes:
                rank = jobs[j].ranks[r]
                head = min(take, len(rank.queue))
                if head:
                    rank.claimed_epoch = max(rank.claimed_epoch, rank.queue[head - 1].epoch)
                    scheduler.drop_queue(rank, _first(head))
    assert min(job.sampler_epoch for job in single[4]) >= 3  # through several epoch ends
    assert batches_larger_than_one > 50  # the batches did batch


def _first(count: int):  # type: ignore[no-untyped-def]
    seen = [0]

    def drop(entry) -> bool:  # type: ignore[no-untyped-def]
        seen[0] += 1
        return seen[0] <= count
    return drop
