"""The registry: joaderd's bookkeeping of jobs, their passes and their Next calls.

`Registry` is what the gRPC servicer calls: it registers jobs (`jobs`), starts and ends their
passes (`passes`, `resumes`), answers Next calls from the queue heads (`next_protocol`,
`queue_heads`; the call's records: `next_call`), files decode results (`filing`), runs the
scheduler in its own thread (`scheduler_thread`), exits when idle (`idle_exit`) and composes
the status snapshot (`status`); the state its parts share is declared once (`state`). It uses the scheduling rules (`joader.server.scheduling`) and
the books (`joader.server.books`).
"""
