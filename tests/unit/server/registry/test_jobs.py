"""The job table (server/registry/jobs.py): ranks joining a job by name, leases, why a job ends, and who
may reach it. Driven directly, without a registry."""

from __future__ import annotations

import logging

import pytest
from pyroaring import BitMap

from joader.errors import InvalidArgumentError, TooManyJobsError, UnknownJobError
from joader.server.registry.jobs import printable_name
from tests.support.job_books import books

pytestmark = pytest.mark.timeout(60)


def test_the_ranks_of_a_job_join_it_by_name_and_a_taken_rank_is_refused() -> None:
    table, _, source, _ = books()
    job, rank0 = table.attach(source, BitMap(range(20)), "ddp", 4, rank=0, world_size=2, seed=3)
    assert not job.all_attached and rank0.attached
    again, rank1 = table.attach(source, BitMap(range(20)), "ddp", 4, rank=1, world_size=2)
    assert again is job and rank1 is job.ranks[1] and job.all_attached
    with pytest.raises(InvalidArgumentError, match="rank 1 is already attached"):
        table.attach(source, BitMap(range(20)), "ddp", 4, rank=1, world_size=2)
    # other indices (or world size) make another job
    other, _ = table.attach(source, BitMap(range(10)), "ddp", 4, rank=1, world_size=2)
    assert other is not job and len(table.jobs) == 2


def test_ranks_must_agree_on_the_seed_and_bad_registrations_name_the_problem() -> None:
    table, _, source, _ = books()
    table.attach(source, BitMap(range(20)), "ddp", 4, rank=0, world_size=2, seed=3)
    with pytest.raises(InvalidArgumentError, match="seed 4.*seed 3"):
        table.attach(source, BitMap(range(20)), "ddp", 4, rank=1, world_size=2, seed=4)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        table.attach(source, BitMap(range(20)), "a", 0)
    with pytest.raises(InvalidArgumentError, match="rank must be in 0..1"):
        table.attach(source, BitMap(range(20)), "a", 4, rank=2, world_size=2)
    with pytest.raises(InvalidArgumentError, match="pass name="):
        table.attach(source, BitMap(range(20)), "", 4, world_size=2)
    with pytest.raises(InvalidArgumentError, match="empty epoch"):
        table.attach(source, BitMap(range(1)), "a", 4, world_size=2, drop_last=True)


def test_ranks_must_agree_on_the_order_and_a_bad_order_names_the_choices() -> None:
    table, _, source, _ = books()
    job, _ = table.attach(source, BitMap(range(20)), "ddp", 4, rank=0, world_size=2, order="independent")
    assert job.order == "independent"
    with pytest.raises(InvalidArgumentError, match="order='shared'.*order='independent'.*same order"):
        table.attach(source, BitMap(range(20)), "ddp", 4, rank=1, world_size=2)
    joined, _ = table.attach(source, BitMap(range(20)), "ddp", 4, rank=1, world_size=2, order="independent")
    assert joined is job
    with pytest.raises(InvalidArgumentError, match="'shared', 'independent'.*got 'random'"):
        table.attach(source, BitMap(range(20)), "b", 4, order="random")
    assert table.attach(source, BitMap(range(20)), "c", 4)[0].order == "shared"


def test_jobs_beyond_max_jobs_are_refused_naming_the_flag() -> None:
    table, _, source, _ = books(max_jobs=2)
    for name in ("a", "b"):
        table.attach(source, BitMap(range(5)), name, 4)
    with pytest.raises(TooManyJobsError, match="--max-jobs"):
        table.attach(source, BitMap(range(5)), "c", 4)


def test_a_job_without_a_seed_gets_one_from_the_source_in_arrival_order() -> None:
    """A rerun of the same jobs on a server with the same --seed draws the same streams."""
    seeds = []
    for _ in range(2):
        table, _, source, _ = books()
        seeds.append([table.attach(source, BitMap(range(5)), n, 4)[0].seed for n in ("a", "b")])
    assert seeds[0] == seeds[1] and seeds[0][0] != seeds[0][1]


def test_closing_ranks_says_why_the_job_ends() -> None:
    table, _, source, _ = books()
    solo, _ = table.attach(source, BitMap(range(5)), "solo", 4)
    assert table.close_rank(solo, 0) == "closed by its client"
    ddp, _ = table.attach(source, BitMap(range(5)), "ddp", 4, rank=0, world_size=3)
    table.attach(source, BitMap(range(5)), "ddp", 4, rank=1, world_size=3)
    assert table.close_rank(ddp, 0) is None  # rank 1 still reads
    reason = table.close_rank(ddp, 1)
    assert reason is not None and "rank 0 and 1 closed while rank 2 of 3 never attached" in reason


def test_leases_expire_without_heartbeats_and_a_client_that_never_asks_loses_its_job() -> None:
    table, _, source, clock = books(lease_s=5.0)
    quiet, _ = table.attach(source, BitMap(range(5)), "quiet", 4)
    alive, rank = table.attach(source, BitMap(range(5)), "alive", 4)
    rank.requested = True  # its client sent a request
    clock.now += 4.0
    table.touch(alive.job_id)
    table.touch(quiet.job_id)
    assert table.expire() == []
    clock.now += 2.0  # past the lease since attaching: the quiet one never sent a request
    expired = dict((job.job_id, why) for job, why in table.expire())
    assert list(expired) == [quiet.job_id] and "sent no request within 5 s" in expired[quiet.job_id]
    clock.now += 6.0  # no heartbeat for a lease
    expired = dict((job.job_id, why) for job, why in table.expire())
    assert "lease expired" in expired[alive.job_id]


def test_a_job_whose_ranks_never_all_attach_expires_naming_them() -> None:
    table, _, source, clock = books(lease_s=100.0, rank_attach_timeout_s=60.0)
    job, _ = table.attach(source, BitMap(range(5)), "ddp", 4, rank=1, world_size=3)
    clock.now += 59.0
    table.touch(job.job_id, 1)
    assert table.expire() == []
    assert table.waiting(job, clock.now)["ranks"] == [0, 2]  # type: ignore[index]
    clock.now += 1.0
    [(gone, why)] = table.expire()
    assert gone is job and "rank 0 and 2 of 3 did not attach within 60 s" in why


def test_a_wrong_secret_and_an_unknown_job_get_the_same_answer_and_a_removed_job_says_why() -> None:
    table, _, source, _ = books()
    job, _ = table.attach(source, BitMap(range(5)), "a", 4)
    assert table.lookup(job.job_id, job.secret) is job
    with pytest.raises(UnknownJobError) as wrong:
        table.lookup(job.job_id, b"guess")
    with pytest.raises(UnknownJobError) as unknown:
        table.lookup("nobody-0000", b"guess")
    assert str(wrong.value).replace(job.job_id, "X") == str(unknown.value).replace("nobody-0000", "X")
    assert table.remove(job.job_id, "its lease expired") is job
    assert table.remove(job.job_id, "again") is None
    with pytest.raises(UnknownJobError, match="removed by joaderd: its lease expired"):
        table.lookup(job.job_id, job.secret)
    assert table.expected_pins() == {}


def test_a_second_live_job_of_a_name_is_served_and_told_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    # NOTE [ Two live jobs of one name ]: the six trials of an Optuna study, all one name.
    table, _, source, _ = books()
    first, first_rank = table.attach(source, BitMap(range(20)), "sweep", 4)
    assert first_rank.notice == ""
    with caplog.at_level("INFO", logger="joader.server.registry.jobs"):  # INFO: any client can attach a name
        second, second_rank = table.attach(source, BitMap(range(20)), "sweep", 4)
    assert second is not first and len(table.jobs) == 2  # accepted: two jobs, both served
    assert second_rank.notice == (
        f"a job named 'sweep' is already attached (job id {first.job_id}); this one ({second.job_id}) "
        "is served as a separate job under the same name. Pass each JoaderDataset its own name= to "
        "tell them apart in joader status")
    assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"][-1] == \
        f"job {second.job_id}: {second_rank.notice}"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    third, third_rank = table.attach(source, BitMap(range(5)), "sweep", 4)  # other indices: still the name
    assert third_rank.notice.startswith(f"2 jobs named 'sweep' are already attached (job id {first.job_id}, "
                                        f"{second.job_id}); this one ({third.job_id})")
    table.remove(first.job_id, "done")
    table.remove(second.job_id, "done")
    assert table.attach(source, BitMap(range(20)), "sweep", 4)[1].notice.startswith(
        f"a job named 'sweep' is already attached (job id {third.job_id})")
    assert table.attach(source, BitMap(range(20)), "other", 4)[1].notice == ""


def test_the_ranks_of_one_job_share_its_name_without_a_notice() -> None:
    table, _, source, _ = books()
    job, rank0 = table.attach(source, BitMap(range(20)), "ddp", 4, rank=0, world_size=2)
    joined, rank1 = table.attach(source, BitMap(range(20)), "ddp", 4, rank=1, world_size=2)
    assert joined is job and rank0.notice == rank1.notice == ""
    # a second run of the name while the first still runs: its ranks are told, each of them
    table.attach(source, BitMap(range(10)), "ddp", 4, rank=0, world_size=2)
    other, other1 = table.attach(source, BitMap(range(10)), "ddp", 4, rank=1, world_size=2)
    assert other is not job and other.ranks[0].notice == other1.notice != ""
    assert f"(job id {job.job_id})" in other1.notice
    # a job with no name is named by its id: never the same as another's
    assert table.attach(source, BitMap(range(20)), "", 4)[1].notice == ""
    assert table.attach(source, BitMap(range(20)), "", 4)[1].notice == ""


def test_job_names_cannot_forge_log_lines() -> None:
    assert printable_name("a\nINFO fake") == "a\\nINFO fake"
    assert len(printable_name("x" * 500)) == 80
