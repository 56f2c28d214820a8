"""Resumes: an epoch resumed from a checkpoint delivers exactly what was not consumed; after a
joaderd restart, the keepers' reports decide what continues (server/registry/resumes.py, through the
registry)."""

from __future__ import annotations

import pytest
from pyroaring import BitMap

from joader.errors import InvalidArgumentError
from joader.server.books.records import Job, RestShare
from joader.server.registry.registry import Registry
from joader.server.registry.resumes import decide_restart
from tests.support.registry_driver import (
    FakePool,
    attach,
    make_registry,
    nxt,
    pump,
    read_epoch,
)

pytestmark = pytest.mark.timeout(60)


def test_a_resumed_epoch_delivers_exactly_what_was_not_consumed_then_whole_epochs() -> None:
    registry, pool, _ = make_registry(num_slots=30)
    before = attach(registry, "demo", BitMap(range(30)), "a", 4)
    pump(registry, pool)
    nxt(registry, before.job_id, 1, 4, [])
    pump(registry, pool)
    consumed = nxt(registry, before.job_id, 1, 4, []).item_ids + nxt(registry, before.job_id, 1, 4, []).item_ids
    registry.remove_job(before.job_id, "the training process was killed")
    job = attach(registry, "demo", BitMap(range(30)), "a", 4)
    order, acks = [], []
    while True:
        pump(registry, pool)
        result = nxt(registry, job.job_id, 9, 4, acks, resume_epoch=3, resume_consumed=BitMap(consumed))
        assert result.epoch == 3  # the checkpoint's numbering goes on
        acks = result.item_ids
        order += result.item_ids
        if result.end_of_epoch:
            break
    assert sorted(order + consumed) == list(range(30))
    assert sorted(read_epoch(registry, pool, job.job_id, token=10)) == list(range(30))


def test_a_resume_waits_for_every_worker_in_any_order() -> None:
    """StatefulDataLoader restores each worker's own state; a worker that had yielded nothing
    has none, and may ask first."""
    registry, pool, _ = make_registry(num_slots=30)
    job = attach(registry, "demo", BitMap(range(24)), "a", 4)
    pump(registry, pool)
    first = nxt(registry, job.job_id, 5, 4, [], worker_id=0, pid=10)  # no state: a plain pass
    assert first.item_ids == []  # nothing prepared yet, so nothing handed out
    # worker 1 brings the checkpoint: the pass becomes epoch 4 resumed, both reports counted
    orders: dict[int, list[int]] = {0: [], 1: []}
    acks: dict[int, list[int]] = {0: [], 1: []}
    done = {0: False, 1: False}
    while not all(done.values()):
        pump(registry, pool)
        for worker in (1, 0):
            if done[worker]:
                continue
            extra = {"resume_epoch": 4, "resume_consumed": BitMap(range(6)), "resume_parts": 2} if worker else {}
            result = nxt(registry, job.job_id, 5, 4, acks[worker], worker_id=worker, pid=10 + worker, **extra)
            assert result.epoch == 4
            acks[worker] = result.item_ids
            orders[worker] += result.item_ids
            done[worker] = result.end_of_epoch
    assert sorted(orders[0] + orders[1]) == list(range(6, 24))


def test_a_pending_resume_gives_way_to_a_new_pass_that_resumes_nothing() -> None:
    """StatefulDataLoader drops the iterator of a finished epoch's checkpoint and starts a fresh
    one: a resume still waiting for its second worker must not hold the job forever."""
    registry, pool, _ = make_registry(num_slots=30)
    job = attach(registry, "demo", BitMap(range(20)), "a", 4)
    nxt(registry, job.job_id, 5, 4, [], worker_id=1, pid=11,
        resume_epoch=2, resume_consumed=BitMap(range(20)), resume_parts=2)
    assert job.resume is not None  # waiting for worker 0's report
    order = read_epoch(registry, pool, job.job_id, token=6)  # a new iterator, no checkpoint
    assert sorted(order) == list(range(20)) and job.resume is None


def test_an_impossible_resume_parts_is_refused_and_a_waiting_resume_is_shown() -> None:
    registry, _, _ = make_registry(num_slots=30)
    job = attach(registry, "demo", BitMap(range(20)), "a", 4)
    with pytest.raises(InvalidArgumentError, match=r"resume_parts 5000 .*1\.\.1024.*num_workers"):
        nxt(registry, job.job_id, 5, 4, [], resume_epoch=2, resume_consumed=BitMap(range(3)), resume_parts=5000)
    assert job.resume is None
    for worker in (0, 1):  # a state that says five readers report; two do
        nxt(registry, job.job_id, 5, 4, [], worker_id=worker, pid=10 + worker,
            resume_epoch=2, resume_consumed=BitMap([worker]), resume_parts=5)
    waiting = registry.status()["jobs"][0]["waiting"]
    assert waiting["for"] == "resume_reports" and waiting["epoch"] == 2
    assert waiting["ranks"] == [{"rank": 0, "reports": 2, "parts": 5}]
    assert "rank 0: 2 of 5" in waiting["detail"]


def test_lease_keepers_reports_resume_a_restarted_ddp_epoch_before_any_reader_asks() -> None:
    """After a restart each rank's lease keeper attaches again with what the rank received of
    its epoch (its client board). The epoch resumes on those reports: rank 0's reader is served
    while rank 1's has not asked (a DDP rank blocked in an all_reduce that waits for rank 0),
    and rank 1's own report, when it comes, joins without a second resume. Exactly once."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(24))
    consumed = {0: BitMap([0, 5, 7]), 1: BitMap([2, 3])}
    jobs = [attach(registry, "demo", items, "ddp", 4, rank=r, world_size=2,
                   restart_report=(2, consumed[r])) for r in (0, 1)]
    job = jobs[0]
    assert jobs[1] is job and job.resume is None and job.resumed_epoch == 2
    got: dict[int, list[int]] = {0: [], 1: []}
    acks: dict[int, list[int]] = {0: [], 1: []}
    done = {0: False, 1: False}

    def ask(rank: int) -> None:
        result = nxt(registry, job.job_id, 7 + rank, 4, acks[rank], rank=rank, resume_epoch=2,
                     resume_consumed=consumed[rank])
        assert result.epoch == 2
        acks[rank] = result.item_ids
        got[rank] += result.item_ids
        done[rank] = result.end_of_epoch

    for _ in range(20):  # rank 0 alone: its next batch comes while rank 1 has not asked
        pump(registry, pool)
        ask(0)
        if got[0]:
            break
    assert len(got[0]) == 4, "rank 0 was not served before rank 1's reader asked"
    for _ in range(200):
        pump(registry, pool)
        for rank in (1, 0):
            if not done[rank]:
                ask(rank)
        if all(done.values()):
            break
    delivered = got[0] + got[1] + list(consumed[0]) + list(consumed[1])
    assert sorted(set(delivered)) == list(range(24)) and len(delivered) - len(set(delivered)) <= 1  # padding


def _read_ddp_epoch(registry: Registry, pool: FakePool, job: Job, asks: dict[int, dict[str, object]],
                    first: int = 0, rounds: int = 300) -> tuple[dict[int, list[int]], set[int]]:
    """Reads one pass per rank to its end (rank `first` is served a batch before the other
    asks, when it can be). `asks[rank]`: the extra fields of that rank's requests (its token
    and any resume fields). Returns each rank's items and the epoch numbers its replies named."""
    got: dict[int, list[int]] = {rank: [] for rank in asks}
    acks: dict[int, list[int]] = {rank: [] for rank in asks}
    done = dict.fromkeys(asks, False)
    epochs: set[int] = set()
    order = [first] + [rank for rank in asks if rank != first]
    for _ in range(rounds):
        pump(registry, pool)
        for rank in order:
            if done[rank]:
                continue
            fields = dict(asks[rank])
            token = int(fields.pop("token"))  # type: ignore[call-overload]
            result = nxt(registry, job.job_id, token, 4, acks[rank], rank=rank, pid=100 + rank, **fields)
            if result.item_ids or result.end_of_epoch:
                epochs.add(result.epoch)
            acks[rank], done[rank] = result.item_ids, result.end_of_epoch
            got[rank] += result.item_ids
            if rank == first and not got[first] and not done[first]:
                break  # the other rank asks once this one had a batch: it sits in an all_reduce
        if all(done.values()):
            return got, epochs
    raise AssertionError(f"the epoch did not end: ranks done {done}, items {[len(g) for g in got.values()]}, "
                         f"waiting {registry.status()['jobs'][0].get('waiting')}")


@pytest.mark.parametrize("stale", [(0,), (0, 1)], ids=["one-rank-stale", "both-ranks-stale"])
def test_after_a_restart_the_next_epoch_is_a_new_pass_whichever_rank_asks_first(stale: tuple[int, ...]) -> None:
    """Issue 27, finding 2. joaderd restarted mid-epoch 1 of a 2-rank job: the lease keepers
    re-attach with what their ranks received (the client board), the interrupted passes finish
    epoch 1. Then epoch 2 starts plainly on both ranks, but a rank whose training process had
    not adopted the restart yet asks with the epoch number it expects (2) and nothing consumed.
    That is a new pass, not a resume: with one rank "resuming" and the other plain, the job sat
    out for the resume report the plain rank never sends (the hang of the 2-host test); with both
    "resuming", rank 0 was handed its queued epoch-2 items while the resume gathered, and the
    resume then dealt the whole epoch again (34 items twice, 34 never). Exactly once, no wait."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(24))
    consumed = {0: BitMap([0, 5, 7, 9]), 1: BitMap([2, 3, 11, 12])}
    job = attach(registry, "demo", items, "ddp", 4, rank=0, world_size=2, restart_report=(1, consumed[0]))
    assert attach(registry, "demo", items, "ddp", 4, rank=1, world_size=2, restart_report=(1, consumed[1])) is job
    interrupted = {rank: {"token": 7 + rank, "resume_epoch": 1, "resume_consumed": consumed[rank]} for rank in (0, 1)}
    got, epochs = _read_ddp_epoch(registry, pool, job, interrupted)
    first = got[0] + got[1] + list(consumed[0]) + list(consumed[1])
    assert epochs == {1} and sorted(first) == list(range(24))
    new = {rank: {"token": 20 + rank} for rank in (0, 1)}
    for rank in stale:
        new[rank].update(resume_epoch=2, resume_consumed=BitMap())
    got, epochs = _read_ddp_epoch(registry, pool, job, new)
    assert epochs == {2}
    assert sorted(got[0] + got[1]) == list(range(24)), (
        f"duplicated {len(got[0]) + len(got[1]) - len(set(got[0] + got[1]))}, "
        f"missing {len(set(range(24)) - set(got[0] + got[1]))}")


def test_a_restarts_resume_is_decided_from_the_keepers_reports_alone() -> None:
    """`decide_restart`: the newest reported epoch resumes without what its ranks received; a
    rank that reported an older epoch is past it (its next pass reads the resumed one), and a
    rank that reported nothing received nothing."""
    assert decide_restart({}, 2) is None
    rest = RestShare(share=9, base=4)
    decision = decide_restart({0: (2, BitMap([1, 2]), None), 1: (1, BitMap(range(12)), rest),
                               3: (2, BitMap([5]), rest)}, 4)
    assert decision is not None and decision.epoch == 2
    assert decision.consumed == [BitMap([1, 2]), BitMap(), BitMap(), BitMap([5])]
    assert decision.claimed == [2, 1, 1, 2] and decision.behind == [1]
    assert decision.rest == [None, None, None, rest]  # rank 1's share was of epoch 1, which is over


def test_after_a_restart_passes_continue_or_start_as_the_client_says_and_the_numbering_goes_on() -> None:
    """The client's own messages after a restart: rank 0's keeper reports epoch 2 (it read 6
    items of it), rank 1's epoch 1 (all its 12; it had not started epoch 2). Rank 0's
    interrupted pass continues epoch 2; rank 1's interrupted pass of epoch 1 ends at once, and
    its new pass reads epoch 2. Then both ranks' next passes are epoch 3, whole: the numbering
    is the client's, whoever adopted the restart first (an acknowledgement once did, and the
    next pass was dealt epoch 1 again)."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(24))
    read = BitMap([0, 4, 8, 12, 16, 20])
    job = attach(registry, "demo", items, "ddp", 4, rank=0, world_size=2, restart_report=(2, read))
    assert job.resumed_epoch == 0  # rank 1 has not attached: nothing decided yet
    nxt(registry, job.job_id, 7, 4, [], rank=0, pid=100, continue_epoch=2)  # before rank 1 attached
    assert attach(registry, "demo", items, "ddp", 4, rank=1, world_size=2,
                  restart_report=(1, BitMap(range(1, 24, 2)))) is job
    assert job.resumed_epoch == 2 and job.resume is None
    ended = nxt(registry, job.job_id, 8, 4, [], rank=1, pid=101, continue_epoch=1)
    assert ended.epoch == 1 and ended.end_of_epoch and not ended.item_ids
    got, epochs = _read_ddp_epoch(registry, pool, job, {0: {"token": 7, "continue_epoch": 2}, 1: {"token": 9}},
                                  first=1)  # the rank furthest from its share is dealt first
    assert epochs == {2} and sorted(got[0] + got[1] + list(read)) == list(range(24))
    assert len(got[0]) == 12 - len(read) and len(got[1]) == 12
    got, epochs = _read_ddp_epoch(registry, pool, job, {0: {"token": 10}, 1: {"token": 11}})
    assert epochs == {3} and sorted(got[0] + got[1]) == list(range(24))


def test_a_pending_resume_hands_out_nothing_of_its_epoch_while_it_gathers() -> None:
    """A checkpoint's resume of epoch 2 waits for rank 1's report; rank 0's queue already holds
    epoch-2 lookahead. Handed out now, those items would be dealt again when the resume starts."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(16))
    job = attach(registry, "demo", items, "ddp", 4, rank=0, world_size=2)
    attach(registry, "demo", items, "ddp", 4, rank=1, world_size=2)
    first, _ = _read_ddp_epoch(registry, pool, job, {0: {"token": 1}, 1: {"token": 2}})
    pump(registry, pool)
    assert any(entry.epoch == 2 for entry in job.ranks[0].queue)  # the next epoch, prepared ahead
    parts = {0: {"token": 3, "resume_epoch": 2, "resume_consumed": BitMap([1])},
             1: {"token": 4, "resume_epoch": 2, "resume_consumed": BitMap([2])}}
    assert nxt(registry, job.job_id, 3, 4, [], rank=0, pid=100, resume_epoch=2,
               resume_consumed=BitMap([1])).item_ids == []
    got, epochs = _read_ddp_epoch(registry, pool, job, parts, first=1)
    assert epochs == {2} and sorted(got[0] + got[1] + [1, 2]) == list(range(16))


def test_a_continued_pass_serves_a_worker_whose_partner_ended_before_the_restart() -> None:
    """Two DataLoader workers read epoch 2; worker 0 had received its part's end when joaderd
    restarted, worker 1 still needed the epoch's last batch. Worker 0 never asks the restarted
    joaderd. The loop's turn (`dealing.turn`) counted on the new server from zero, so worker 0's
    "next batch" came first and worker 1 waited for it for good (`bench/soak/restart_storm.py
    --mode workers`: the job sat with its last batch queued for ten minutes). A pass a restart
    interrupted is dealt without the turn: what each worker was served is on the dead server."""
    registry, pool, _ = make_registry(num_slots=40)
    job = attach(registry, "demo", BitMap(range(24)), "a", 4, restart_report=(2, BitMap(range(20))))
    order: list[int] = []
    acks: list[int] = []
    for _ in range(50):
        pump(registry, pool)
        reply = nxt(registry, job.job_id, 9, 4, acks, worker_id=1, pid=11, num_workers=2, continue_epoch=2)
        assert reply.epoch == 2
        acks = reply.item_ids
        order += reply.item_ids
        if reply.end_of_epoch:
            break
    assert sorted(order) == [20, 21, 22, 23]


def _elastic_reports(consumed: BitMap, share: int) -> dict[int, dict[str, object]]:
    return {rank: {"token": 20 + rank, "resume_epoch": 2, "resume_consumed": BitMap(consumed),
                   "resume_rest": RestShare(share, len(consumed))} for rank in range(3)}


def _read_resumed(registry: Registry, pool: FakePool, job: Job,
                  asks: dict[int, dict[str, object]]) -> tuple[dict[int, list[int]], set[int]]:
    """`_read_ddp_epoch` of a resume: every rank but the last asks (reports) first, as the ranks
    of a resumed DDP job each do before the epoch can start; nothing is served before."""
    last = max(asks)
    for rank, fields in asks.items():
        if rank != last:
            fields = dict(fields)
            token = int(fields.pop("token"))  # type: ignore[call-overload]
            assert nxt(registry, job.job_id, token, 4, [], rank=rank, pid=100 + rank, **fields).item_ids == []
    return _read_ddp_epoch(registry, pool, job, asks, first=last)


@pytest.mark.parametrize("drop_last", [False, True], ids=["padding", "drop_last"])
def test_an_elastic_resume_deals_the_rest_in_equal_shares_to_the_new_ranks(drop_last: bool) -> None:
    """NOTE [ An elastic resume ]: 2 ranks consumed 8 of 26 items of epoch 2; the checkpoint
    resumes on 3 ranks, each reporting the union with its share of the 18 left: 6 each, every
    rest item once. Then whole epochs of 9 (8 under drop_last). The whole-epoch rule would have
    given each new rank 9 - 8 = 1 item (the union is more than one rank's share)."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(26))
    consumed = BitMap([0, 3, 5, 7, 11, 13, 17, 19])
    job = None
    for rank in range(3):
        job = attach(registry, "demo", items, "ddp", 4, rank=rank, world_size=3, drop_last=drop_last)
    assert job is not None
    share = 6  # 18 // 3 == ceil(18 / 3)
    got, epochs = _read_resumed(registry, pool, job, _elastic_reports(consumed, share))
    assert epochs == {2}
    assert [len(got[rank]) for rank in range(3)] == [share] * 3
    assert sorted(got[0] + got[1] + got[2]) == sorted(items - consumed)
    whole, epochs = _read_ddp_epoch(registry, pool, job, {rank: {"token": 30 + rank} for rank in range(3)})
    assert epochs == {3}
    per = 8 if drop_last else 9
    assert [len(whole[rank]) for rank in range(3)] == [per] * 3
    assert len(set(whole[0] + whole[1] + whole[2])) == (24 if drop_last else 26)


def test_an_elastic_rest_goes_on_from_what_each_rank_consumed_since() -> None:
    """A checkpoint saved in an elastic resume's epoch (each rank's consumed set: the union it
    resumed from plus what it read since) resumes on the same ranks: each rank's target is its
    rest share less what it read beyond the union, and every item of the rest still comes
    once. Here rank 0 read 2 items of its share of 5 and rank 1 read 3; 16 items, 6 before."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(16))
    union = BitMap([1, 2, 3, 4, 5, 6])
    read = {0: BitMap([7, 8]), 1: BitMap([9, 10, 11])}
    job = None
    for rank in range(2):
        job = attach(registry, "demo", items, "ddp", 4, rank=rank, world_size=2)
    assert job is not None
    asks: dict[int, dict[str, object]] = {
        rank: {"token": 40 + rank, "resume_epoch": 5, "resume_consumed": union | read[rank],
               "resume_rest": RestShare(5, len(union))} for rank in range(2)}
    got, epochs = _read_resumed(registry, pool, job, asks)
    assert epochs == {5}
    assert [len(got[0]), len(got[1])] == [3, 2]
    assert sorted(got[0] + got[1]) == sorted(items - union - read[0] - read[1])


def test_a_restart_in_an_elastic_resumes_epoch_goes_on_from_each_ranks_share() -> None:
    """joaderd restarted while 2 ranks read an elastic resume's rest: each keeper reports the
    union the rank resumed from plus what it read since, with its share. The restarted joaderd
    deals each rank its share less what it read since (the whole-epoch rule would give it
    nothing: the union is more than a rank's epoch), every rest item once."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(20))
    union = BitMap(range(10))  # what the old layout's ranks consumed
    read = {0: BitMap([10, 11]), 1: BitMap([12])}
    job = None
    for rank in range(2):
        job = attach(registry, "demo", items, "ddp", 4, rank=rank, world_size=2,
                     restart_report=(3, union | read[rank], RestShare(5, len(union))))
    assert job is not None and job.resumed_epoch == 3
    got, epochs = _read_ddp_epoch(registry, pool, job, {rank: {"token": 50 + rank, "continue_epoch": 3}
                                                        for rank in range(2)})
    assert epochs == {3} and [len(got[0]), len(got[1])] == [3, 4]
    assert sorted(got[0] + got[1]) == sorted(items - union - read[0] - read[1])
