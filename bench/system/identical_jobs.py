"""Issue 3's sharing check: three identical jobs, one epoch each, a cache of a quarter.

Three jobs at the same speed read the 1,200-image demo dataset once each, started together (as a
sweep is), against one joaderd whose cache holds a quarter of the prepared dataset. Prints the
within-epoch sharing (deliveries per decode, each job once per decoded copy; ideal 3) and checks every epoch is exactly once.

Usage: python -m bench.system.identical_jobs [--items 1200] [--step-s 0.1] [--reps 3]
Writes bench/results/identical_jobs.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.common import (
    RESULTS,
    Server,
    demo_data,
    median,
    quarter_cache_bytes,
    run_jobs,
    simjob_command,
    start_margin_s,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    root = demo_data(args.items)
    runs = []
    for rep in range(args.reps):
        with Server(root, quarter_cache_bytes(args.items), workers=2) as server:
            start_at = time.time() + start_margin_s(3)
            reports = run_jobs([simjob_command(f"j{i}", address=server.address, batch_size=32,
                                              step_s=args.step_s, start_at=start_at, record=True)
                                for i in range(3)])
            status = server.status()
        exactly_once = all(sorted(r["epochs"][0]["order"]) == list(range(args.items)) for r in reports)
        runs.append({"sharing_within_epoch": status["sharing"]["within_epoch"], "items_decoded": status["items_decoded"],
                     "items_delivered": status["items_delivered"], "exactly_once": exactly_once})
        print(f"rep {rep}: within-epoch sharing {status['sharing']['within_epoch']:.3f} "
              f"({status['items_delivered']} delivered / {status['items_decoded']} decoded), "
              f"exactly once: {exactly_once}", flush=True)
    sharing = median([r["sharing_within_epoch"] for r in runs])
    print(f"median within-epoch sharing {sharing:.3f} (target >= 2.7, ideal 3)")
    (RESULTS / "identical_jobs.json").write_text(json.dumps(
        {"items": args.items, "step_s": args.step_s, "runs": runs, "median_sharing_within_epoch": sharing,
         "command": "python -m bench.system.identical_jobs"}, indent=2))
    return 0 if sharing >= 2.7 and all(r["exactly_once"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
