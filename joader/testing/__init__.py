"""What joader's tests and its benches both use, shipped like numpy.testing: the pixel oracle of
fault tests (`integrity`), the jobs they run as processes (`simjob`, the emulated training job;
`integrity_job`, a job that records every sample), user stages that crash or hang a decode
worker, the chaos soak, the drift simulation, the shared-memory budget scenario, torchvision's
reference decode and free ports.

Nothing in joader/, server/ or client/ imports it. It sits above the layers, as tests/ and bench/
do: its jobs use the client (imported lazily, as `joader` itself does), and the drift simulation
and the shm-budget scenario drive the server's own classes.
"""
