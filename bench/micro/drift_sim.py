"""Jobs that drift, simulated against joaderd's real registry: every scenario under every rule set.

    python -m bench.micro.drift_sim --table          (every scenario x rule set, 3 seeds; ~10 minutes)
    python -m bench.micro.drift_sim [--jobs 3] [--items 1437] [--epochs 5] [--stagger] ...

The simulation (its options, what it reports) is `joader.testing.drift_sim`; the in-step test of
tests/unit/server runs it too. `--table` writes bench/results/drift_sim.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from joader.testing.drift_sim import Simulation, parse

SCENARIOS = {  # name -> arguments: the digits sweep's shape (1,437 items, a 27 ms CPU step)
    "together, 30% jitter": [],
    "together, 60% jitter": ["--jitter", "0.6"],
    "staggered by half an epoch": ["--stagger"],
    "speeds 1x, 2x, 4x": ["--steps", "0.027,0.054,0.108"],
}
RULES = {  # name -> registry settings
    "before (one batch of slack)": ["plan_horizon=0", "max_hold_s=0"],
    "planning ahead": ["plan_horizon=0.5", "max_hold_s=0"],
    "planning ahead + holds": ["plan_horizon=0.5", "max_hold_s=1.0"],
}


def table(seeds: int) -> dict[str, Any]:
    """Every scenario under every rule set, CPU-bound (2 cores shared by steps and decodes):
    medians over `seeds` seeds of jobs served per decode, and the slowest job's time."""
    out: dict[str, Any] = {}
    for scenario, extra in SCENARIOS.items():
        for rules, settings in RULES.items():
            argv = ["--epochs", "5", "--decode-s", "0.0003", "--steps", "0.027", "--cores", "2", *extra]
            for setting in settings:
                argv += ["--server-arg", setting]
            runs = [Simulation(parse(argv + ["--seed", str(seed)])).run() for seed in range(1, seeds + 1)]
            served = sorted(r["served_per_decode"] for r in runs)
            slowest = sorted(max(r["ends"]) for r in runs)
            out.setdefault(scenario, {})[rules] = {
                "served_per_decode": served[len(served) // 2], "runs": served,
                "makespan_s": slowest[len(slowest) // 2], "exact": all(r["exact"] for r in runs)}
            print(f"{scenario:28s} {rules:28s} served/decode {served[len(served) // 2]:.2f} {served} "
                  f"makespan {slowest[len(slowest) // 2]:.2f} s, exactly once {all(r['exact'] for r in runs)}",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.table:
        data = table(args.seeds if args.seeds > 1 else 3)
        path = Path(__file__).resolve().parents[1] / "results" / "drift_sim.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path}")
        return 0
    for seed in range(args.seed, args.seed + args.seeds):
        args.seed = seed
        result = Simulation(args).run()
        print(json.dumps({k: v for k, v in result.items() if k != "pairs"}))
        for pair in result["pairs"]:
            print("   ", pair)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
