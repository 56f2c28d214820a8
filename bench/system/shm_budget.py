"""Do a user's auto-sized joaderds leave room for the training process's own shared memory?

    sudo python -m bench.system.shm_budget [--shm-size 1g] [--items 100] [--no-budget] [--together] [--auto]

The scenario (what it starts, what it checks, its options) is `joader.testing.shm_budget`;
tests/integration/test_shm_budget.py runs it too. Writes
bench/results/shm_budget[-no-budget][-together][-auto].json.
"""

from __future__ import annotations

from pathlib import Path

from joader.testing.shm_budget import main

RESULTS = Path(__file__).resolve().parents[1] / "results"

if __name__ == "__main__":
    raise SystemExit(main(results=RESULTS))
