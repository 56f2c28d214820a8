"""The books: joaderd's data model and the cache's accounts of items, sizes and rates.

`records` holds the data model (sources, items, jobs, ranks, entries); `item_cache` the items in
the cache arena, their states, slots and eviction order; `item_sizes` what each item's decoded
size is expected to be; `recipients` which jobs received each cached copy; `cache_audit` the
cache's books checked and repaired against the jobs'; `pacing` each job's consumption rate and
the due time of each decode; `containment` how a bookkeeping error is contained to the job it
concerns; `source_watch` each source's health on disk (`Source.watch`) and the thread that
checks it. The bottom layer of the server: it imports nothing from the other server packages.
"""
