"""Scheduling: which items each job's ranks get next, and in what order they are decoded.

`Scheduler` plans the rounds that fill each rank's queue from the job's sampling order, keeping
jobs that share a source in step (`in_step`) and running rounds in batches (`batches`), and the
dealing rules (`dealing`) decide which rank a Next call serves. Pure logic over the books (`joader.server.books`); the registry drives it.
"""
