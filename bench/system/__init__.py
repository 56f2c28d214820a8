"""System benches: whole jobs against a real joaderd, joader against plain DataLoaders (multi_job,
four_jobs, async_jobs, identical_jobs, analyze, autoscale, cache_fill, scale, shm_budget, multi_host)."""
