"""The decode pool: joaderd's worker processes that read and decode items into the cache arena.

A forker process (forked before joaderd imports grpc) starts the decode workers; `DecodePool`
hands them tasks earliest-due first, reads their results, and handles their faults: a worker that
dies or overruns its timeout is replaced, the files that kill workers are quarantined, and the
pool is resized between its bounds. Nothing outside this package imports more than
`decode_pool` (joaderd's start-up creates the pool; the registry submits to it through a protocol).
"""
