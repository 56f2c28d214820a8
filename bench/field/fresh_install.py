"""Does `pip install` of this clone give a working joader in a fresh environment that already has
torch, and does it leave that torch alone?

The install a user makes (README, "Install"; docs/install.md), step by step, each step timed:
1. a fresh virtualenv in a temporary directory (`--python`, default this interpreter);
2. torch installed first, the documented way (`--torch`, default the Makefile's `torch==2.13.0`,
   which is the CPU wheel on this machine; `--torch-index-url https://download.pytorch.org/whl/cpu`
   where that index is reachable);
3. `pip install --dry-run --report` of joader: what pip would install (torch must not be in it);
4. joader installed NON-editable from a copy of the clone (its tracked and untracked, not ignored
   files, as `git clone` plus your edits would give, so the clone gets no build/ or egg-info), or
   with `--from wheel` from a wheel built of that copy (`pip wheel --no-deps`);
5. checks: torch's version, its dist-info and `torch/__init__.py` (inode and mtime) unchanged, and
   no `torch-` in pip's "Uninstalling"/"Successfully installed" lines; every file of the clone's
   packages (`joader/`, `server/`, `client/`, e.g. the .proto and .pyi beside the generated
   modules) installed under `joader/`;
6. the smoke test, run outside the clone so that `import joader` is the installed copy:
   `joaderd --help`, `joader --help`, `from joader import JoaderDataset`, `joader
   make-demo-data` (`--items`, 128), joaderd on it as source `demo` (its defaults, a 64 MiB
   cache), one epoch read with `DataLoader(JoaderDataset("demo", return_index=True))` (every
   index exactly once), `joader status`, joaderd stopped with SIGTERM (exit 0);
7. with `--sweeps`: `ray[tune]` and `optuna` installed too (torch checked again), then
   `examples/ray_tune_sweep.py` and `examples/optuna_sweep.py` of the clone run as the README
   shows them, with no joaderd started by hand (`--root` the demo data; `--sweep-args` passed to
   both), no auto-started joaderd left once they are over, and `bench.field.sweeps` (one repetition, 2
   epochs, 600 items) from a copy of bench/: each sweep's wall against folder datasets, exact
   epochs, jobs served per decode, what is left running;
8. the temporary directory, venv included, removed (`--keep` keeps it and says where).

Usage (from the repository root, with any python3 >= 3.11; it imports only the standard library):
    python3 -m bench.field.fresh_install [--from clone|wheel] [--sweeps] [--torch SPEC]
        [--torch-index-url URL] [--python PATH] [--items 128] [--keep] [--label NAME]

It prints a table of the steps (seconds, ok) and exits 1 if a step failed or torch was touched.
Results go to bench/results/fresh_install-<label>.json (label: the `--from` and `+sweeps`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MAKEFILE_TORCH = "torch==2.13.0"  # the Makefile's TORCH
# The clone's package folders and where they install (pyproject.toml, [tool.setuptools.package-dir])
PACKAGE_DIRS = {"joader": "joader", "server": "joader/server", "client": "joader/client"}
SWEEP_EXAMPLES = ("examples/ray_tune_sweep.py", "examples/optuna_sweep.py")
SWEEP_PACKAGES = ("ray[tune]", "optuna")
_LOG_TAIL_LINES = 30

# Run by the venv's python in the scratch folder: one epoch, every index exactly once.
_READ_EPOCH = """
import collections, json, sys, time
import torch
import joader
from joader import JoaderDataset
address, expected = sys.argv[1], int(sys.argv[2])
start = time.monotonic()
seen, shapes = collections.Counter(), set()
with JoaderDataset("demo", address=address, return_index=True, name="fresh-install") as ds:
    for indices, images, labels in torch.utils.data.DataLoader(ds, batch_size=16):
        seen.update(indices.tolist())
        shapes.add(tuple(images.shape[1:]))
print(json.dumps({"joader_file": joader.__file__, "torch": torch.__version__, "items": sum(seen.values()),
                  "distinct": len(seen), "exactly_once": sorted(seen) == list(range(expected))
                  and set(seen.values()) == {1}, "shapes": sorted(shapes), "epoch_s": time.monotonic() - start}))
"""

# Run by the venv's python: what identifies the installed torch.
_TORCH_IDENTITY = """
import importlib.metadata as md, json, os
dist = md.distribution("torch")
record = next(f for f in dist.files if f.name == "RECORD").locate()
init, rec = os.stat(dist.locate_file("torch/__init__.py")), os.stat(record)
print(json.dumps({"version": dist.version, "record": str(record), "record_inode": rec.st_ino,
                  "init_inode": init.st_ino, "init_mtime_ns": init.st_mtime_ns}))
"""


class Run:
    """The steps of one check: each timed, logged to its own file, and kept for the table."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.logs = scratch / "logs"
        self.logs.mkdir()
        self.steps: list[dict[str, Any]] = []

    def step(self, name: str, command: list[str], *, timeout_s: float = 1800, cwd: Path | None = None,
             env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        log = self.logs / f"{len(self.steps):02d}-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.log"
        shown = [arg if "\n" not in arg else "<script>" for arg in command]
        print(f"fresh_install: {name}: {' '.join(shown)}", flush=True)
        start = time.monotonic()
        try:
            done = subprocess.run(command, cwd=cwd or self.scratch, env=env, text=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s)
            output, code = done.stdout, done.returncode
        except subprocess.TimeoutExpired as error:
            output = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
            output += f"\n(timed out after {timeout_s:g} s)"
            code = -1
            done = subprocess.CompletedProcess(command, code, output)
        seconds = time.monotonic() - start
        log.write_text(output)
        self.steps.append({"step": name, "command": shown, "seconds": round(seconds, 2), "ok": code == 0,
                           "exit_code": code})
        if code != 0:
            tail = "\n".join(output.splitlines()[-_LOG_TAIL_LINES:])
            print(f"fresh_install: {name} FAILED (exit {code}, {seconds:.1f} s); the end of {log}:\n{tail}",
                  flush=True)
            if check:
                raise StepFailed(name)
        return done

    def note(self, name: str, ok: bool, seconds: float = 0.0, detail: str = "") -> None:
        """A step that is a check made here, not a command."""
        self.steps.append({"step": name, "command": [], "seconds": round(seconds, 2), "ok": ok, "detail": detail})
        print(f"fresh_install: {name}: {'ok' if ok else 'FAILED'}{': ' + detail if detail else ''}", flush=True)


class StepFailed(Exception):
    pass


def copy_clone(source: Path, dest: Path) -> int:
    """Copies what `git clone` plus the working tree's edits hold (tracked and untracked files,
    not ignored ones), so no .venv, build/ or egg-info comes along; a plain copy without those if
    `source` is not a git work tree. Returns the number of files."""
    listed = subprocess.run(["git", "-C", str(source), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if listed.returncode == 0:
        names = [n for n in listed.stdout.decode().split("\0") if n and (source / n).is_file()]
        for name in names:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, dest / name)
        return len(names)
    ignore = shutil.ignore_patterns(".venv", "build", "*.egg-info", "__pycache__", ".git", "demo-data")
    shutil.copytree(source, dest, ignore=ignore, dirs_exist_ok=True)
    return sum(1 for p in dest.rglob("*") if p.is_file())


def package_files(src: Path) -> set[str]:
    """The files the clone's packages should install, as paths under site-packages."""
    files = set()
    for folder, installed in PACKAGE_DIRS.items():
        base = src / folder
        for path in base.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and (path.parent / "__init__.py").exists():
                files.add(f"{installed}/{path.relative_to(base).as_posix()}")
    return files


def installed_files(site: Path) -> set[str]:
    return {p.relative_to(site).as_posix() for p in (site / "joader").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def torch_identity(run: Run, python: Path, name: str) -> dict[str, Any]:
    done = run.step(name, [str(python), "-c", _TORCH_IDENTITY], timeout_s=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


def pip_touched_torch(log: str) -> list[str]:
    """pip's lines that uninstalled or installed a torch distribution (not torchdata etc.)."""
    pattern = re.compile(r"\btorch-\d")
    return [line.strip() for line in log.splitlines()
            if (line.lstrip().startswith(("Uninstalling", "Successfully installed", "Would install"))
                and pattern.search(line))]


def check_torch(run: Run, python: Path, before: dict[str, Any], pip_log: str, after_what: str) -> bool:
    after = torch_identity(run, python, f"torch after {after_what}")
    touched = pip_touched_torch(pip_log)
    same = after == before and not touched
    detail = (f"torch {after['version']} left as it was" if same else
              f"torch CHANGED: before {before}, after {after}; pip: {touched}")
    run.note(f"torch untouched by {after_what}", same, detail=detail)
    return same


def wait_no_servers(bindir: Path, env: dict[str, str], timeout_s: float) -> list[Any]:
    """The auto-started joaderds still running after `timeout_s` (each exits on its own, or at
    the end of its `joader.serve` block)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run([str(bindir / "joader"), "servers", "--json"], env=env, capture_output=True,
                             text=True, timeout=60)
        left = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def wait_ready(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = json.loads(path.read_text())
            if isinstance(info, dict) and "address" in info:
                return info
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if proc.poll() is not None:
            raise StepFailed(f"joaderd exited with code {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise StepFailed(f"joaderd not ready within {timeout_s:g} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.field.fresh_install", description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="origin", choices=("clone", "wheel"), default="clone",
                        help="install the clone's folder (default) or a wheel built from it")
    parser.add_argument("--source", type=Path, default=ROOT, help="the clone (default: this repository)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
    parser.add_argument("--torch", default=MAKEFILE_TORCH, help=f"torch's requirement (default {MAKEFILE_TORCH})")
    parser.add_argument("--torch-index-url", help="e.g. https://download.pytorch.org/whl/cpu")
    parser.add_argument("--items", type=int, default=128, help="demo JPEGs for the smoke epoch")
    parser.add_argument("--sweeps", action="store_true", help="also install ray[tune] and optuna and run the "
                        "sweep examples")
    parser.add_argument("--sweep-args", default="", help="arguments passed to each sweep example")
    parser.add_argument("--sweep-timeout-s", type=float, default=1800)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (venv, logs)")
    parser.add_argument("--label", help="results file label (default: the --from, +sweeps)")
    args = parser.parse_args(argv)
    label = args.label or (args.origin + ("-sweeps" if args.sweeps else ""))
    source = args.source.resolve()

    scratch = Path(tempfile.mkdtemp(prefix="jfi-", dir="/tmp"))  # short: joaderd's socket lives here
    run = Run(scratch)
    venv = scratch / "venv"
    python, bindir = venv / "bin" / "python", venv / "bin"
    pip = [str(python), "-m", "pip"]
    result: dict[str, Any] = {"bench": "fresh_install", "label": label, "from": args.origin,
                              "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                              "commit": _commit(source), "torch_spec": args.torch,
                              "torch_index_url": args.torch_index_url, "python": args.python}
    server: subprocess.Popen[bytes] | None = None
    server_log = None
    torch_ok = False
    started = time.monotonic()
    try:
        t0 = time.monotonic()
        src = scratch / "src"
        src.mkdir()
        count = copy_clone(source, src)
        run.note("copy the clone", count > 0, time.monotonic() - t0, f"{count} files from {source}")

        run.step("create the venv", [args.python, "-m", "venv", str(venv)], timeout_s=300)
        result["pip_version"] = run.step("pip version", [*pip, "--version"]).stdout.split()[1]
        index = ["--index-url", args.torch_index_url] if args.torch_index_url else []
        run.step("install torch", [*pip, "install", args.torch, *index])
        before = torch_identity(run, python, "torch before joader")
        result["torch_before"] = before

        target = str(src)
        if args.origin == "wheel":
            wheels = scratch / "wheels"
            run.step("build the wheel", [*pip, "wheel", "--no-deps", "-w", str(wheels), str(src)])
            target = str(next(wheels.glob("joader-*.whl")))
            result["wheel_bytes"] = Path(target).stat().st_size
        report = scratch / "dry-run.json"
        dry = run.step("dry run", [*pip, "install", "--dry-run", "--report", str(report), target])
        would = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}"
                       for i in json.loads(report.read_text())["install"])
        result["would_install"] = would
        torch_planned = [w for w in would if w.lower().startswith("torch==")] + pip_touched_torch(dry.stdout)
        run.note("dry run leaves torch", not torch_planned, detail=f"{len(would)} to install"
                 + (f"; torch among them: {torch_planned}" if torch_planned else ", torch not among them"))

        done = run.step(f"install joader ({args.origin})", [*pip, "install", target])
        torch_ok = check_torch(run, python, before, done.stdout, "joader") and not torch_planned
        site = Path(run.step("site-packages", [str(python), "-c", "import joader, os; "
                                               "print(os.path.dirname(os.path.dirname(joader.__file__)))"]
                             ).stdout.strip().splitlines()[-1])
        missing = sorted(package_files(src) - installed_files(site))
        run.note("every package file installed", not missing,
                 detail="all of joader/, server/, client/" if not missing else f"missing: {missing[:20]}")

        run.step("joaderd --help", [str(bindir / "joaderd"), "--help"], timeout_s=120)
        run.step("joader --help", [str(bindir / "joader"), "--help"], timeout_s=120)
        run.step("import JoaderDataset", [str(python), "-c", "from joader import JoaderDataset"], timeout_s=120)
        data = scratch / "demo-data"
        run.step("joader make-demo-data", [str(bindir / "joader"), "make-demo-data", str(data),
                                           "--items", str(args.items)], timeout_s=600)

        ready = scratch / "ready.json"
        t0 = time.monotonic()
        server_log = open(run.logs / "joaderd.log", "wb")
        server = subprocess.Popen(
            [str(bindir / "joaderd"), "--source", f"demo={data}", "--listen", f"unix:{scratch / 'jd.sock'}",
             "--cache-size", "64MiB", "--ready-file", str(ready), "--log-level", "WARNING"],
            cwd=scratch, stdin=subprocess.DEVNULL, stdout=server_log, stderr=subprocess.STDOUT)
        address = wait_ready(ready, server, 120)["address"]
        run.note("joaderd ready", True, time.monotonic() - t0, address)
        done = run.step("read one epoch", [str(python), "-c", _READ_EPOCH, address, str(args.items)], timeout_s=600)
        epoch = json.loads(done.stdout.strip().splitlines()[-1])
        result["epoch"] = epoch
        from_venv = Path(epoch["joader_file"]).is_relative_to(venv)
        run.note("epoch exactly once, from the installed joader", epoch["exactly_once"] and from_venv,
                 detail=f"{epoch['items']} items, {epoch['distinct']} distinct, shapes {epoch['shapes']}, "
                 f"joader from {'the venv' if from_venv else epoch['joader_file']}")
        run.step("joader status", [str(bindir / "joader"), "status", "--address", address], timeout_s=120)

        if args.sweeps:
            done = run.step("install ray[tune], optuna", [*pip, "install", *SWEEP_PACKAGES])
            torch_ok = check_torch(run, python, before, done.stdout, "ray[tune], optuna") and torch_ok
            # As the README shows them: no joaderd started by hand (the examples' trials and the
            # Ray driver's joader.serve start one for --root), in a private runtime directory.
            runtime = Path(tempfile.mkdtemp(prefix="jfi-", dir="/tmp"))
            runtime.chmod(0o700)
            env = {k: v for k, v in os.environ.items() if k not in ("JOADER_ADDRESS", "PYTHONPATH")}
            env.update(XDG_RUNTIME_DIR=str(runtime), JOADER_IDLE_EXIT_S="10", RAY_USAGE_STATS_ENABLED="0")
            for example, extra in zip(SWEEP_EXAMPLES, (["--cpus-per-trial", "0.5"], []), strict=True):
                script = src / example
                run.step(f"run {example}", [str(python), str(script), "--root", str(data), "--image-size", "64",
                                            *extra, *args.sweep_args.split()], env=env,
                         timeout_s=args.sweep_timeout_s, check=False)
            left = wait_no_servers(bindir, env, 60)
            run.note("no joaderd left after the examples", not left, detail=f"left: {left}" if left else "none")
            # The bench of the same sweeps (wall against folder datasets, exact epochs, served per
            # decode, leftovers), run from a copy of bench/ so that `import joader` is the venv's.
            benchdir = scratch / "benchcode"
            shutil.copytree(src / "bench", benchdir / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
            done = run.step("bench.field.sweeps", [str(python), "-m", "bench.field.sweeps", "--reps", "1", "--epochs", "2",
                                             "--items", "600", "--name", f"fresh_install-{label}-sweeps"],
                            env=dict(env, PYTHONPATH=str(benchdir)), cwd=benchdir,
                            timeout_s=args.sweep_timeout_s, check=False)
            table = [line for line in done.stdout.splitlines() if line.strip()][-8:]
            result["sweeps_table"] = table
            print("\n".join(table), flush=True)
            for made in (benchdir / "bench" / "results").glob("*.json"):
                shutil.copy(made, RESULTS / made.name)
            shutil.rmtree(runtime, ignore_errors=True)

        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        server = None
        run.note("joaderd stopped by SIGTERM", code == 0, time.monotonic() - t0, f"exit code {code}")
    except StepFailed as error:
        if not run.steps or run.steps[-1]["ok"] is not False:
            run.note(str(error), False)
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.wait()
        if server_log is not None:
            server_log.close()
        if args.keep:
            print(f"fresh_install: kept {scratch} (venv, logs, data)", flush=True)
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    result["total_s"] = round(time.monotonic() - started, 1)
    result["torch_untouched"] = torch_ok
    result["steps"] = run.steps
    ok = torch_ok and all(s["ok"] is not False for s in run.steps)
    result["ok"] = ok
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"fresh_install-{label}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print()
    print("| step | s | ok |")
    print("|---|---|---|")
    for s in run.steps:
        mark = "skipped" if s["ok"] is None else ("yes" if s["ok"] else "**NO**")
        print(f"| {s['step']} | {s['seconds']:.1f} | {mark} |")
    print(f"\nfresh_install ({args.origin}{', sweeps' if args.sweeps else ''}): {'ok' if ok else 'FAILED'} in "
          f"{result['total_s']:.0f} s; torch {'untouched' if torch_ok else 'TOUCHED or unchecked'}; results in {out}")
    return 0 if ok else 1


def _commit(source: Path) -> str | None:
    done = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    return done.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
