"""The chaos soak's command line: `joader.testing.chaos`'s soak, run long, its summary written.

    python -m bench.soak.chaos [--duration-s 1200] [--seed 0] [--quick] [--episode-s 150]

What the soak runs and checks is in `joader.testing.chaos` (tests/integration/test_chaos.py runs its
short form). Writes bench/results/chaos-<timestamp>.json; exits 1 if anything is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from joader.testing import chaos

RESULTS = Path(__file__).resolve().parents[1] / "results"

def main() -> int:
    parser = argparse.ArgumentParser(description=chaos.__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=1200.0, help="fault injection time (default 20 min)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--items", type=int, default=240, help="demo JPEGs in the source")
    parser.add_argument("--epochs", type=int, default=3, help="most epochs per job (each runs 1 to this many)")
    parser.add_argument("--fault-every-s", type=float, default=6.0, help="mean time between faults")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--episode-s", type=float, default=150.0,
                        help="length of each configuration's episode (joaderd restarted with the next)")
    parser.add_argument("--join-late-s", type=float, default=8.0, help="latest start of a slot's first job")
    parser.add_argument("--caches", default=",".join(c[0] for c in chaos.CACHES),
                        help="the cache sizes episodes draw from (comma-separated; default all)")
    parser.add_argument("--quick", action="store_true", help="two minutes, episodes of 40 s")
    args = parser.parse_args()
    if args.quick:
        args.duration_s, args.episode_s = 120.0, 40.0
    summary = chaos.soak(args.duration_s, args.seed, items=args.items, epochs=args.epochs, fault_every_s=args.fault_every_s,
                   image_size=args.image_size, episode_s=args.episode_s, join_late_s=args.join_late_s,
                   caches=tuple(args.caches.split(",")))
    print(f"chaos: {summary.line()}")
    print("chaos: configurations run:")
    for number, episode in enumerate(summary.episodes, 1):
        print(f"  {number:3d}. {episode}")
    for problem in summary.problems[:20]:
        print(f"  {problem}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({**asdict(summary), "ok": summary.ok, "args": vars(args)}, indent=2))
    print(f"chaos: {'OK' if summary.ok else 'FAILED'}; wrote {out}")
    return 0 if summary.ok else 1



if __name__ == "__main__":
    sys.exit(main())
