"""joader's benchmarks: each module is a script, run from the repository root as
`python -m bench.NAME` (`make bench` runs the quick forms). `bench.common` holds what they share;
`bench.simjob` is the emulated training job they (and the integration tests) start."""
