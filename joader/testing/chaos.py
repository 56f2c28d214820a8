"""The chaos soak: jobs in every client mode under random faults, every delivered sample checked.

    python -m bench.soak.chaos [--duration-s 1200] [--seed 0] [--quick] [--episode-s 150]

It proves content, not counts. A real joaderd serves generated JPEGs; jobs run as separate processes (`joader/testing/integrity_job.py`, a real
torch DataLoader over JoaderDataset) in every mode: num_workers 0 and 2, plain and
`batched=True`, with and without a transform, the dataset asking in the loader's batch size or
its own, hand-off workers (workers, batched, no transform),
DataLoaders re-seeded before each epoch, one rank of a job whose other ranks are on other
hosts (it reads its host's part), overlapping subsets (two slots on the same one, so that
new jobs start aligned epochs: --epoch-align first), different speeds.

The soak spans what users run, in *episodes* (`--episode-s` each; joaderd is started afresh with
the episode's configuration, drawn from the seeded RNG and printed):
- the cache: one batch per job, a few batches per job, half the prepared data, or more than
  all of it (items reused across epochs: the sweep that crashed joaderd, issue 27);
- 1 to 8 job slots of the modes above, each slot's first job joining up to `--join-late-s` late;
- `--epoch-align` first (the default, most episodes), off or always; `--fronts` 0, 1 or 2;
- each job runs 1 to 3 epochs; half of them attach and build "a model" for up to 3 s before
  their first read (a job attached and not reading while another starts is what crashed the
  sweep); one in four ends early, mid-epoch (a trial a scheduler stopped: it closes its dataset
  and exits).
Each job slot runs job after job for its episode. Meanwhile, at random times from a seeded RNG:

- joaderd is killed -9 and started again on the same address (mid-epoch; or exactly when a job
  reads the last batch of an epoch, its acknowledgement and next epoch's prefetch in flight);
- a job is killed -9 and started again from its checkpoint (num_workers=0 jobs, which save
  `ds.state_dict()` after every batch; what they received after it is dropped from their
  records, as a lost training step would be);
- a decode worker is killed -9;
- in episodes with Next fronts (`--fronts` 0, 1 or 2, drawn per episode), a front is killed -9:
  joaderd must exit 70 on its own, and is started again as after a crash.

Every job records, per sample, its epoch, index, label and the crc32 of its pixels; the checker
compares each with a decode of that file made here, outside joaderd, and each epoch of each job
with its subset: exactly once. `JOADER_VERIFY=1` is set for the jobs (the client checks each
item's crc32 against its decode's). It prints and writes (bench/results/chaos-*.json): samples
checked, wrong pixels, wrong labels, duplicated, missing, jobs failed, restarts survived, client
and worker kills, server crashes (joaderd exiting on its own) and the internal errors its status
counted (`internal_errors`: bookkeeping bugs it contained); and exits 1 if anything is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from joader.client.tools.demo_data import make_demo_data
from joader.launch import JoaderdProcess
from joader.testing.integrity import (
    Findings,
    check_records,
    complete_epochs,
    read_records,
    reference,
)

ROOT = Path(__file__).resolve().parents[2]  # the repository: the jobs' working directory
BATCH = 8
# The episode's cache, in what it holds: (name, batches per job or None, share of all prepared data)
CACHES = (("one-batch-per-job", 1, None), ("few-batches-per-job", 3, None), ("half-the-data", None, 0.5),
          ("more-than-the-data", None, 1.5))
CACHE_NAMES = tuple(name for name, _, _ in CACHES)
ALIGNS = ("first", "first", "off", "always")  # the default most often


@dataclass(frozen=True)
class Mode:
    """One job slot: its subset of the source, its client options, its speed."""

    name: str
    indices: str
    options: tuple[str, ...]
    sleep_s: float
    killable: bool = False  # saves checkpoints (num_workers=0): may be killed -9 and resumed
    source: str = "demo"  # "sized": the same images through resize:S (exactly sized decodes)
    env: tuple[tuple[str, str], ...] = ()  # torchrun's variables: a rank of a job across hosts

    def subset(self) -> set[int]:
        """The items this slot's job reads each epoch: its indices, or under `env` (a rank of a
        job across hosts) its host's part of them, cut as the client cuts it."""
        items = set(range(*map(int, self.indices.split(":"))))
        if not self.env:
            return items
        from pyroaring import BitMap

        from joader.sampling.hosts import host_part, layout_from_env, source_salt

        env = dict(self.env)
        layout = layout_from_env(int(env["RANK"]), int(env["WORLD_SIZE"]), env)
        assert layout is not None
        return set(host_part(BitMap(items), source_salt(self.source), layout, drop_last=False))


def modes(num_items: int) -> list[Mode]:
    n = num_items
    return [
        Mode("plain", f"0:{n * 2 // 3}", ("--follow-loader",), 0.02, killable=True),
        # The plain slot's subset: each new job of one slot starts while the other is
        # mid-epoch, so its first epoch is aligned (joaderd's default --epoch-align first).
        Mode("batched", f"0:{n * 2 // 3}", ("--batched",), 0.05, killable=True),
        # resize:S: each decode placed in exactly its bytes, known from the file's header
        # (a probe) or prepared first and placed after (joader.server.books.item_cache).
        Mode("transform", f"0:{n}:2", ("--transform", "--source", "sized"), 0.0, killable=True,
             source="sized"),
        Mode("workers", f"{n // 6}:{n * 5 // 6}", ("--workers", "2", "--follow-loader"), 0.03),
        Mode("workers-transform", f"0:{n}:3", ("--workers", "2", "--transform"), 0.0),
        Mode("handoff", f"0:{n // 2}", ("--workers", "2", "--batched"), 0.04),
        Mode("handoff-transform", f"{n // 4}:{n * 3 // 4}", ("--workers", "2", "--batched", "--transform"), 0.01),
        Mode("reseeded", f"{n // 2}:{n}", ("--workers", "2", "--reseed"), 0.02),
        # Rank 2 of a 3-rank job whose other ranks are on other hosts (their joaderds): this
        # host's joaderd serves it its part, as rank 0 of this host's job (joader.sampling.hosts).
        Mode("other-host", f"0:{n}", (), 0.02, killable=True,
             env=(("RANK", "2"), ("WORLD_SIZE", "3"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"))),
    ]


@dataclass
class Run:
    """One job of a slot: a few epochs, then the slot starts another."""

    mode: Mode
    number: int
    records: Path
    state: Path | None
    epochs: int = 2
    stop_after_batches: int = 0  # ends early, mid-epoch (0: runs all its epochs)
    setup_s: float = 0.0  # attached, then this long before its first read (a model being built)
    proc: subprocess.Popen[bytes] | None = None
    kills: int = 0
    err_at: int = 0  # where the newest launch's stderr starts in the run's .err file
    done: bool = False
    failed: str = ""


@dataclass(frozen=True)
class Episode:
    """One configuration of joaderd and its jobs (the module docstring)."""

    cache: str
    cache_bytes: int
    slots: tuple[str, ...]
    epoch_align: str
    join_late_s: float
    fronts: int = 0  # joaderd's --fronts (Next fronts, server/fronts/)

    def describe(self) -> str:
        return (f"cache {self.cache} ({self.cache_bytes / 2**20:.1f} MiB), {len(self.slots)} slot(s) "
                f"[{', '.join(self.slots)}], --epoch-align {self.epoch_align}, --fronts {self.fronts}, "
                f"joins up to {self.join_late_s:g} s late")


@dataclass
class Summary:
    seed: int
    duration_s: float = 0.0
    samples_checked: int = 0
    wrong_pixels: int = 0
    wrong_labels: int = 0
    duplicated: int = 0
    missing: int = 0
    jobs_run: int = 0
    jobs_failed: int = 0
    joaderd_restarts: int = 0
    restarts_at_epoch_end: int = 0
    client_kills: int = 0
    worker_kills: int = 0
    front_kills: int = 0  # a Next front killed -9: joaderd exits 70, and is started again
    attach_retries: int = 0  # jobs started in a restart's window, refused at once, started again
    jobs_ended_early: int = 0
    server_crashes: int = 0  # joaderd exited without being killed or stopped
    internal_errors: int = 0  # bookkeeping errors joaderd contained (its status), each a bug
    episodes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.wrong_pixels or self.wrong_labels or self.duplicated or self.missing or self.jobs_failed
                    or self.server_crashes or self.internal_errors)

    def line(self) -> str:
        return (f"samples checked {self.samples_checked}, wrong pixels {self.wrong_pixels}, wrong labels "
                f"{self.wrong_labels}, duplicated {self.duplicated}, missing {self.missing}; jobs {self.jobs_run} "
                f"(failed {self.jobs_failed}); joaderd restarts {self.joaderd_restarts} "
                f"({self.restarts_at_epoch_end} at an epoch's end), client kills {self.client_kills}, "
                f"worker kills {self.worker_kills}, front kills {self.front_kills}; jobs ended early {self.jobs_ended_early}; server "
                f"crashes {self.server_crashes}, internal errors {self.internal_errors}; episodes "
                f"{len(self.episodes)}")


class Soak:
    """The server, the job slots, the faults and the checks of one soak."""

    next_progress: float  # when the next progress line is printed (set by `run`)

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.rng = random.Random(args.seed)
        # Next fronts are drawn from a stream of their own: a seed's episodes and faults stay
        # what they were before fronts were part of the soak (its short form's seed among them).
        self.fronts_rng = random.Random(f"fronts-{args.seed}")
        self.summary = Summary(seed=args.seed)
        data = work / "images"
        make_demo_data(data, args.items, num_classes=5, seed=args.seed, progress=False)
        self.data = data
        print(f"chaos: decoding the reference of {args.items} items outside joaderd ...", flush=True)
        self.expected = {"demo": reference(data, args.image_size),
                         "sized": reference(data, args.image_size, stage="resize")}
        self.modes = {mode.name: mode for mode in modes(args.items)}
        # resize:S keeps the demo's 4:3 aspect: its items are a third larger than center-crop's
        self.item_nbytes = 3 * args.image_size * (args.image_size * 4 // 3 + 1)
        self.data_bytes = args.items * (3 * args.image_size ** 2 + self.item_nbytes)  # both sources
        self.episode: Episode | None = None
        self.episode_ends = 0.0
        self.server_starts = 0
        self.address = f"unix:{work / 'joaderd.sock'}"
        self.server: JoaderdProcess | None = None
        self.runs: dict[str, Run] = {}
        self.finished: list[Run] = []
        self.env = {**os.environ, "JOADER_VERIFY": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    # ----------------------------------------------------------------------------- processes

    def start_server(self) -> None:
        self.server_starts += 1  # each start its own log: an episode's first start comes after no restart
        log = self.work / f"joaderd-{self.server_starts}.log"
        episode = self.episode
        assert episode is not None
        args = ["--listen", self.address, "--cache-size", str(episode.cache_bytes), "--image-size",
                str(self.args.image_size), "--workers", "2", "--lease-s", "3", "--source", f"demo={self.data}",
                "--source", f"sized={self.data}", "--stage", "sized=resize", "--epoch-align", episode.epoch_align,
                "--fronts", str(episode.fronts)]
        self.server = JoaderdProcess.start(args, stdout=log, ready_timeout_s=120, env=self.env)
        self.server_log = log

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.proc.kill()
        self.server.proc.wait()
        self.server.kill()  # releases the launcher's files

    def start_run(self, mode: Mode, number: int | None = None) -> Run:
        number = self.summary.jobs_run if number is None else number
        records = self.work / f"{mode.name}-{number}.jsonl"
        state = self.work / f"{mode.name}-{number}.state" if mode.killable else None
        epochs = self.rng.randint(1, self.args.epochs)
        batches = epochs * -(-len(mode.subset()) // BATCH)
        stop_after = self.rng.randint(1, max(1, batches - 1)) if self.rng.random() < 0.25 else 0
        setup_s = round(self.rng.uniform(0.2, 3.0), 2) if self.rng.random() < 0.5 else 0.0
        run = Run(mode, number, records, state, epochs=epochs, stop_after_batches=stop_after, setup_s=setup_s)
        self.summary.jobs_run += 1
        self.launch(run)
        return run

    def launch(self, run: Run) -> None:
        command = [sys.executable, "-m", "joader.testing.integrity_job", "--address", self.address,
                   "--records", str(run.records), "--name", f"{run.mode.name}-{run.number}",
                   "--indices", run.mode.indices, "--epochs", str(run.epochs), "--sleep", str(run.mode.sleep_s),
                   "--batch-size", str(BATCH), "--timeout-s", "120", *run.mode.options]
        if run.stop_after_batches:
            command += ["--stop-after-batches", str(run.stop_after_batches)]
        if run.setup_s:
            command += ["--setup-s", str(run.setup_s)]
        if run.state is not None:
            command += ["--state", str(run.state)]
        err = open(self.work / f"{run.mode.name}-{run.number}.err", "ab")
        run.err_at = err.tell()  # what this launch writes starts here
        run.proc = subprocess.Popen(command, cwd=ROOT, env={**self.env, **dict(run.mode.env)}, stderr=err, stdout=subprocess.DEVNULL,
                                    start_new_session=True)
        err.close()

    # ----------------------------------------------------------------------------- checks

    def reap(self) -> None:
        """Checks runs that ended; starts the next run of their slot while the soak goes on."""
        for name, run in list(self.runs.items()):
            assert run.proc is not None
            code = run.proc.poll()
            if code is None:
                continue
            if code != 0:
                err = (self.work / f"{run.mode.name}-{run.number}.err").read_text(errors="replace")
                if _never_attached(err[run.err_at:]):
                    # Started while joaderd was down (a restart's window): a job that cannot
                    # attach fails at once, as documented; the slot starts it again.
                    self.summary.attach_retries += 1
                    self.launch(run)
                    continue
                run.failed = f"{name}-{run.number} exited with {code}: {err[-1500:]}"
            self.check(run)
            del self.runs[name]
            if not self.stopping and time.monotonic() < self.episode_ends:
                self.runs[name] = self.start_run(run.mode)

    def check(self, run: Run) -> None:
        summary = self.summary
        subset = run.mode.subset()
        records = read_records(run.records)
        complete = complete_epochs(records)
        ended_early = any(record.get("kind") == "stopped" for record in records)
        summary.jobs_ended_early += ended_early
        if not run.failed and not ended_early and complete != run.epochs:
            run.failed = f"{run.mode.name}-{run.number} exited 0 after {complete} of its {run.epochs} epochs"
        findings = check_records(records, self.expected[run.mode.source], subset, complete,
                                 f"{run.mode.name}-{run.number}", Findings())
        summary.samples_checked += findings.checked
        summary.wrong_pixels += findings.wrong_pixels
        summary.wrong_labels += findings.wrong_labels
        summary.duplicated += findings.duplicated
        summary.missing += findings.missing
        if run.failed:
            summary.jobs_failed += 1
            summary.problems.append(run.failed)
        summary.problems.extend(findings.problems[:3])
        self.finished.append(run)

    # ----------------------------------------------------------------------------- faults

    def restart_server(self, at_epoch_end: bool = False) -> None:
        self.kill_server()
        time.sleep(self.rng.uniform(0.1, 1.5))
        self.start_server()
        self.summary.joaderd_restarts += 1
        self.summary.restarts_at_epoch_end += at_epoch_end

    def restart_at_epoch_end(self) -> bool:
        """Kills joaderd when a job reads the last batch of an epoch (within 20 s)."""
        run = self.rng.choice(list(self.runs.values()))
        size = len(run.mode.subset())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and run.proc is not None and run.proc.poll() is None:
            counts: dict[int, int] = {}
            for record in read_records(run.records) if run.records.exists() else []:
                if record.get("kind") == "sample":
                    counts[record["epoch"]] = counts.get(record["epoch"], 0) + 1
            if counts and size - BATCH <= counts[max(counts)] < size:
                self.restart_server(at_epoch_end=True)
                return True
            time.sleep(0.01)
        return False

    def kill_client(self) -> bool:
        killable = [run for run in self.runs.values() if run.mode.killable and run.proc is not None
                    and run.proc.poll() is None and run.state is not None and run.state.exists()]
        if not killable:
            return False
        run = self.rng.choice(killable)
        assert run.proc is not None
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        run.kills += 1
        self.summary.client_kills += 1
        self.launch(run)
        return True

    def kill_worker(self) -> bool:
        assert self.server is not None
        try:
            status = json.loads(subprocess.run(
                [sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--address", self.address],
                capture_output=True, text=True, timeout=30, env=self.env).stdout)
        except (json.JSONDecodeError, subprocess.TimeoutExpired):
            return False
        pids = status.get("workers", {}).get("pids") or []
        if pids:
            try:
                os.kill(self.rng.choice(pids), signal.SIGKILL)
                self.summary.worker_kills += 1
                return True
            except ProcessLookupError:
                pass
        return False

    # ----------------------------------------------------------------------------- episodes

    def draw_episode(self) -> Episode:
        """The next configuration (the module docstring), from the soak's seeded RNG."""
        rng = self.rng
        names = list(self.modes)
        slots = tuple(sorted(rng.sample(names, rng.randint(1, min(8, len(names))))))
        cache, batches, share = rng.choice([c for c in CACHES if c[0] in self.args.caches])
        if batches is not None:
            cache_bytes = len(slots) * batches * BATCH * self.item_nbytes
        else:
            cache_bytes = int(share * self.data_bytes)
        return Episode(cache, cache_bytes, slots, rng.choice(ALIGNS),
                       rng.choice([0.0, self.args.join_late_s / 2, self.args.join_late_s]),
                       self.fronts_rng.choice((0, 1, 2)))

    def kill_front(self) -> bool:
        """A Next front killed -9: joaderd must exit 70 on its own (its lost replies' items are
        dealt again only by a restart), and is started again, as after a crash."""
        assert self.server is not None and self.episode is not None
        listed = self.status().get("fronts")
        fronts = [f["pid"] for f in listed if f.get("ready")] if isinstance(listed, list) else []
        if not fronts:
            return False
        try:
            os.kill(self.fronts_rng.choice(fronts), signal.SIGKILL)
        except ProcessLookupError:
            return False
        try:
            code = self.server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        if code != 70:
            self.summary.problems.append(f"joaderd did not exit 70 within 30 s of a front's kill (it gave {code})")
            self.summary.server_crashes += 1
        self.server.kill()
        time.sleep(self.fronts_rng.uniform(0.1, 1.0))
        self.start_server()
        self.summary.front_kills += 1
        self.summary.joaderd_restarts += 1
        return True

    def status(self) -> dict[str, object]:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--address", self.address],
                capture_output=True, text=True, timeout=30, env=self.env).stdout
            return json.loads(out)
        except (json.JSONDecodeError, subprocess.TimeoutExpired):
            return {}

    def check_server(self) -> None:
        """joaderd exited on its own (not killed, not stopped by the soak): a crash. Counted,
        its log's tail kept, and started again so that the soak goes on."""
        assert self.server is not None
        code = self.server.proc.poll()
        if code is None:
            return
        self.summary.server_crashes += 1
        tail = self.server_log.read_text(errors="replace")[-2000:] if self.server_log.exists() else ""
        self.summary.problems.append(f"joaderd exited on its own with {code}: {tail}")
        self.server.kill()
        self.start_server()

    def run_episode(self, episode: Episode, until: float, faults: list[str]) -> None:
        """One episode: joaderd with its configuration, its slots' jobs (joining late), faults,
        then every job finished and checked, and joaderd's internal errors read off its status."""
        self.episode = episode
        self.episode_ends = until
        self.summary.episodes.append(episode.describe())
        print(f"chaos: episode {len(self.summary.episodes)}: {episode.describe()}", flush=True)
        self.start_server()
        started = time.monotonic()
        joins = {name: started + self.rng.uniform(0, episode.join_late_s) for name in episode.slots}
        next_fault = started + self.rng.expovariate(1 / self.args.fault_every_s)
        # A client or worker kill that found nothing to kill is tried again every half second
        # (it costs nothing), not after the faults queued behind it: those include epoch-end
        # restarts that wait up to 20 s each, and a short soak on a loaded machine saw no
        # client kill in its minute (test_chaos asks one).
        retry: str | None = None
        retry_at = 0.0
        while time.monotonic() < until:
            now = time.monotonic()
            if retry is not None and now >= retry_at and self.runs:
                if (self.kill_client() if retry == "client" else self.kill_worker()):
                    retry = None
                retry_at = now + 0.5
            for name, at in list(joins.items()):
                if now >= at:
                    del joins[name]
                    self.runs[name] = self.start_run(self.modes[name])
            self.check_server()
            self.reap()
            if now >= next_fault and self.runs:
                # Every kind once first (a short soak must see each), then at random.
                if not faults and episode.fronts and self.fronts_rng.random() < 1 / 12:
                    kind = "front"  # as often as a weight of 1 beside the others' 11
                else:
                    kind = faults.pop(0) if faults else \
                        self.rng.choices(["restart", "epoch_end", "client", "worker"], [4, 2, 3, 2])[0]
                if kind == "restart":
                    self.restart_server()
                elif kind == "front":
                    self.kill_front()
                elif kind == "epoch_end":
                    if not self.restart_at_epoch_end():
                        faults.append(kind)
                elif kind == "client" or kind == "worker":
                    if not (self.kill_client() if kind == "client" else self.kill_worker()):
                        if retry is None:  # nothing to kill yet: again soon
                            retry, retry_at = kind, now + 0.5
                        else:
                            faults.append(kind)
                next_fault = time.monotonic() + self.rng.expovariate(1 / self.args.fault_every_s)
            if now >= self.next_progress:
                print(f"chaos: {now - self.started:5.0f} s  {self.summary.line()}", flush=True)
                self.next_progress = now + 30
            time.sleep(0.05)
        if retry is not None:  # still to be seen: the next episode tries it at its next fault
            faults.append(retry)
        deadline = time.monotonic() + 300
        while self.runs and time.monotonic() < deadline:
            self.check_server()
            self.reap()
            time.sleep(0.1)
        for name, run in self.runs.items():  # did not finish: a failure
            assert run.proc is not None
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
            run.failed = f"{name}-{run.number} did not finish within 300 s of its episode's end"
            self.check(run)
        self.runs.clear()
        self.check_server()
        errors = int(self.status().get("internal_errors", 0) or 0)  # type: ignore[call-overload]
        if errors:
            self.summary.internal_errors += errors
            self.summary.problems.append(f"episode {len(self.summary.episodes)}: joaderd contained {errors} "
                                         f"internal error(s); its log: {self.server_log}")
        assert self.server is not None
        code = self.server.stop(timeout_s=20)
        if code not in (0, -signal.SIGTERM):
            self.summary.server_crashes += 1
            self.summary.problems.append(f"joaderd exited with {code} when stopped; its log: {self.server_log}")
        self.server = None

    def run(self) -> Summary:
        self.started = started = time.monotonic()
        self.stopping = False
        self.next_progress = started + 30
        faults = ["client", "restart", "worker", "epoch_end"]
        try:
            while True:
                left = self.args.duration_s - (time.monotonic() - started)
                if left <= 0:
                    break
                # The last episode takes what is left if less than half an episode would remain.
                length = left if left < 1.5 * self.args.episode_s else self.args.episode_s
                self.run_episode(self.draw_episode(), time.monotonic() + length, faults)
        finally:
            self.stopping = True
            for run in self.runs.values():
                if run.proc is not None and run.proc.poll() is None:
                    os.killpg(run.proc.pid, signal.SIGKILL)
                    run.proc.wait()
            if self.server is not None:
                self.server.stop(timeout_s=20)
        self.summary.duration_s = round(time.monotonic() - started, 1)
        return self.summary


def _never_attached(err: str) -> bool:
    """The launch's stderr says it failed at its first attach (no joaderd answered): started,
    or started again from its checkpoint, in a restart's window. Nothing was delivered to it."""
    return "_start_keeper" in err and "ConnectionError: no joaderd is answering" in err


def soak(duration_s: float, seed: int, *, items: int = 240, epochs: int = 3, fault_every_s: float = 6.0,
         image_size: int = 32, episode_s: float = 150.0, join_late_s: float = 8.0,
         caches: tuple[str, ...] = CACHE_NAMES, work: Path | None = None) -> Summary:
    """One soak (what `tests/integration/test_chaos.py` runs in its short form)."""
    args = argparse.Namespace(duration_s=duration_s, seed=seed, items=items, epochs=epochs,
                              fault_every_s=fault_every_s, image_size=image_size, episode_s=episode_s,
                              join_late_s=join_late_s, caches=caches)
    tmp = Path(tempfile.mkdtemp(prefix="chaos-", dir=work))
    summary = Soak(args, tmp).run()
    if summary.ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        summary.problems.insert(0, f"the soak's files (logs, records) are kept in {tmp}")
    return summary
