"""Field benches: what users run, as they run it (real training jobs, Ray Tune and Optuna sweeps,
root= jobs and the tools beside them, a fresh pip install)."""
