"""The auto-start on a host shared with another local user, tried with two real accounts.

An attacker (one account) prepares the victim's predictable auto-start directory before the
victim's first job: a world-writable one with symlinks into the victim's home, one the victim
cannot write, or a lock the attacker holds. The victim (another account) then starts a job with
`root=` (`ensure_server`, what `JoaderDataset(root=...)` calls first). Each time the victim's
files must be untouched and the job refused at once, by an error naming the directory (or the
lock) and its owner. Needs root, to create the two accounts and act as each.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import ROOT


def _open_to_others(path: str) -> bool:
    """Whether an account with no rights of its own can run `path` (every directory on the way
    searchable by others)."""
    real = Path(os.path.realpath(path))
    return real.is_file() and all(p.stat().st_mode & stat.S_IXOTH for p in (real, *real.parents))


def _interpreter() -> str | None:
    """A Python another account can run: this one, or the system's of the same version (this
    one may live in root's home). The venv's packages are added by `site.addsitedir`."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return next((p for p in (sys.executable, f"/usr/bin/python{version}") if _open_to_others(p)), None)


def _dir_open_to_others(path: str) -> bool:
    """Whether an account with no rights of its own can read the directory `path`."""
    real = Path(os.path.realpath(path))
    return real.is_dir() and bool(real.stat().st_mode & stat.S_IROTH) and all(
        p.stat().st_mode & stat.S_IXOTH for p in (real, *real.parents))


PYTHON = _interpreter()
SITE = next(p for p in sys.path if p.endswith("site-packages"))
READABLE = _dir_open_to_others(str(ROOT)) and _dir_open_to_others(SITE)
PRELUDE = f"import site, sys; site.addsitedir({SITE!r}); sys.path.insert(0, {str(ROOT)!r})\n"

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.getuid() != 0 or shutil.which("useradd") is None,
                       reason="needs root and useradd: the test acts as two real local users"),
    pytest.mark.skipif(PYTHON is None, reason=f"no Python {sys.version_info.major}.{sys.version_info.minor} "
                                              "that another account may run"),
    pytest.mark.skipif(not READABLE, reason="the checkout or its venv is in a directory other accounts cannot "
                                            "enter"),
]

VICTIM, ATTACKER = "joader-victim", "joader-attacker"
QUICK_S = 20.0  # "at once": well under the 120 s a start may take (START_TIMEOUT_S)


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int


def _account(name: str) -> Account:
    """The local account `name`, created if missing (kept: creating one is slow and racy under
    xdist; the lock makes parallel sessions create it once)."""
    with open("/tmp/joader-test-accounts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True)
            entry = pwd.getpwnam(name)
    return Account(name, entry.pw_uid, entry.pw_gid)


@dataclass
class Host:
    """A /tmp of the test's own (sticky, world-writable, as /tmp is), the victim's home with two
    files worth keeping, and a source the victim can read."""

    tmp: Path
    home: Path
    data: Path
    victim: Account
    attacker: Account

    @property
    def victim_dir(self) -> Path:
        """Where the victim's auto-start lives without XDG_RUNTIME_DIR: `$TMPDIR/joader-<uid>`."""
        return self.tmp / f"joader-{self.victim.uid}"

    def env(self, account: Account) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JOADER_", "XDG_RUNTIME"))}
        env.update(TMPDIR=str(self.tmp), HOME=str(self.home), PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        return env

    def run_as(self, account: Account, code: str, timeout_s: float = QUICK_S) -> subprocess.CompletedProcess[str]:
        assert PYTHON is not None
        return subprocess.run([PYTHON, "-c", PRELUDE + code], user=account.uid, group=account.gid, extra_groups=[],
                              env=self.env(account), cwd="/", capture_output=True, text=True, timeout=timeout_s)

    def victim_job(self, timeout_s: float = QUICK_S) -> tuple[subprocess.CompletedProcess[str], float]:
        """The victim's first job with `root=`: finds or starts its joaderd."""
        started = time.monotonic()
        done = self.run_as(self.victim, (
            "from joader.client.autostart import ServerSpec, ensure_server\n"
            f"print(ensure_server(ServerSpec.make('demo', {str(self.data)!r}, image_size=64)))\n"), timeout_s)
        print(f"victim's job ({time.monotonic() - started:.2f} s): {done.stderr.strip().splitlines()[-1:]}")
        return done, time.monotonic() - started

    def spec_names(self) -> str:
        """The spec's file stem, computed the way an attacker would: with joader itself."""
        done = self.run_as(self.attacker, (
            "from joader.client.autostart import ServerSpec\n"
            f"print(ServerSpec.make('demo', {str(self.data)!r}, image_size=64).socket_path().stem)\n"))
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()


@pytest.fixture
def host() -> Iterator[Host]:
    victim, attacker = _account(VICTIM), _account(ATTACKER)
    base = Path(tempfile.mkdtemp(prefix="jsh-", dir="/tmp"))  # short: socket paths hold 107 bytes
    tmp, home, data = base / "tmp", base / "home", base / "data"
    tmp.mkdir()
    tmp.chmod(0o1777)
    home.mkdir(mode=0o700)
    (home / "precious.txt").write_text("the victim's thesis\n")
    (home / "notes.txt").write_text("the victim's notes\n")
    for path in (home, home / "precious.txt", home / "notes.txt"):
        os.chown(path, victim.uid, victim.gid)
    (data / "cats").mkdir(parents=True)
    (data / "cats" / "a.ppm").write_bytes(b"P6 1 1 255\n\x01\x02\x03")
    base.chmod(0o755)
    try:
        yield Host(tmp, home, data, victim, attacker)
    finally:
        _kill_users_processes(victim, attacker)
        shutil.rmtree(base, ignore_errors=True)


def _kill_users_processes(*accounts: Account) -> None:
    """A joaderd the victim's job started (there is none when the job is refused) goes too."""
    uids = {str(a.uid) for a in accounts}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid and str(entry.stat().st_uid) in uids:
                    os.kill(int(entry.name), 9)
            except OSError:
                continue


def _victims_files(host: Host) -> dict[str, str]:
    return {name: (host.home / name).read_text() for name in ("precious.txt", "notes.txt")}


def test_a_squatted_directory_with_symlinks_into_the_victims_home_is_refused(host: Host) -> None:
    """The tester's attack: a 0777 directory, the spec's .json and .log linked to the victim's
    files. Today's main truncated precious.txt, wrote the spec into it and appended to notes.txt."""
    stem = host.spec_names()
    done = host.run_as(host.attacker, (
        "import os\n"
        f"d = {str(host.victim_dir)!r}\n"
        "os.mkdir(d); os.chmod(d, 0o777)\n"
        f"os.symlink({str(host.home / 'precious.txt')!r}, os.path.join(d, {stem + '.json'!r}))\n"
        f"os.symlink({str(host.home / 'notes.txt')!r}, os.path.join(d, {stem + '.log'!r}))\n"))
    assert done.returncode == 0, done.stderr
    before = _victims_files(host)

    job, took_s = host.victim_job()

    assert _victims_files(host) == before
    assert job.returncode != 0 and "UntrustedServerError" in job.stderr, job.stderr
    assert str(host.victim_dir) in job.stderr and f"{ATTACKER} (uid {host.attacker.uid})" in job.stderr
    assert "mode 0o777" in job.stderr and "set XDG_RUNTIME_DIR" in job.stderr
    assert took_s < QUICK_S


def test_a_directory_of_another_user_the_victim_cannot_write_is_refused_by_name(host: Host) -> None:
    """A 0755 directory of the attacker's: today a raw PermissionError on the lock file."""
    done = host.run_as(host.attacker, f"import os; os.mkdir({str(host.victim_dir)!r}, 0o755)\n")
    assert done.returncode == 0, done.stderr

    job, took_s = host.victim_job()

    assert job.returncode != 0 and "UntrustedServerError" in job.stderr, job.stderr
    assert f"the directory {host.victim_dir} belongs to {ATTACKER} (uid {host.attacker.uid})" in job.stderr
    assert f"not to you ({VICTIM} (uid {host.victim.uid}))" in job.stderr
    assert "PermissionError: [Errno" not in job.stderr
    assert took_s < QUICK_S


def test_a_lock_held_by_another_user_is_refused_at_once_by_name(host: Host) -> None:
    """The victim's own private directory, but the spec's lock held by a process of the
    attacker's (handed the open file, as a leaked descriptor would be): today the job waited
    the whole start timeout, then blamed "another process"."""
    stem = host.spec_names()
    host.victim_dir.mkdir(mode=0o700)
    lock = host.victim_dir / f"{stem}.lock"
    lock.touch(mode=0o600)
    for path in (host.victim_dir, lock):
        os.chown(path, host.victim.uid, host.victim.gid)
    fd = os.open(lock, os.O_RDWR)
    holder = subprocess.Popen(
        [str(PYTHON), "-c", f"import fcntl, sys, time; fcntl.flock({fd}, fcntl.LOCK_EX); print('held', flush=True); "
                               "sys.stdin.read()"],
        user=host.attacker.uid, group=host.attacker.gid, extra_groups=[], pass_fds=(fd,),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    os.close(fd)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        job, took_s = host.victim_job(timeout_s=QUICK_S + 10)
    finally:
        holder.kill()
        holder.wait()

    assert job.returncode != 0 and "UntrustedServerError" in job.stderr, job.stderr
    assert f"the lock {lock} is held by pid {holder.pid} of {ATTACKER} (uid {host.attacker.uid})" in job.stderr
    assert took_s < QUICK_S
    assert stat.S_IMODE(host.victim_dir.stat().st_mode) == 0o700
