"""joader's benchmarks, grouped by kind: `micro`, `system`, `soak`, `field`, `peers`. Each module
is a script, run from the repository root as `python -m bench.GROUP.NAME` (`make bench` runs the
quick forms). `bench.common` holds what they share; what they share with the tests (the emulated
training job `simjob`, the pixel oracle, the chaos soak, ...) is `joader.testing`."""
