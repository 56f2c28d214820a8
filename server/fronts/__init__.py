"""Next fronts (joader.server.fronts): gRPC servers in processes of their own that relay jobs'
`Next` calls to joaderd, so that gRPC's per-call work leaves joaderd's one GIL.

NOTE [ Next fronts ]
~~~~~~~~~~~~~~~~~~~~
joaderd's books (the registry, the scheduler, the cache) are one Python process under one lock;
that is what keeps every epoch exactly once. A `Next` call costs grpc.aio about 270 us of that
process's CPU whatever the reply's size (HTTP/2, the completion queue, the asyncio glue:
`bench/micro/grpc_floor.py`), 4 us per item at a batch of 64. A front is a process that runs a
grpc.aio server for `Next` alone and hands each call to joaderd as the request's bytes on a
socket pair (`server/wire.py` framing); joaderd answers with the reply's bytes. joaderd then
spends about 45 us a call beyond its books (parsing the request, serializing the reply, the
link), and the front about 330. The fronts, one core each at most, carry the gRPC part; more
fronts, more cores, and joaderd's ceiling is its books alone (bench/README.md, "scale": at
64-256 items a reply the books' per-item work, not gRPC, is most of what is left).

- A job learns its front from its Attach reply (`next_address`); its lease stream, `Attach`,
  `Status` and every call of an older client stay on joaderd's own socket, which serves `Next`
  as before. The lease keeper checks a front's socket as it checks joaderd's (`verify_server`:
  our directory, our uid) before it publishes it.
- A front binds a socket of its own beside joaderd's (`.joaderd-<pid>-next<k>.sock`), is told
  nothing but a socket pair's descriptor, and exits when joaderd closes its end (joaderd's exit,
  even a SIGKILL: the kernel closes it).
- A front that dies while serving is a failure of joaderd (exit 70), as a supervised thread's
  death is: the replies it carried may have been lost after joaderd handed out their items, and
  only a restart (the keepers attach again and resume from what the readers consumed) brings
  those items back. A front that fails to start is not: joaderd logs why and serves `Next` on its
  own socket (`Fronts`, fronts.py).
- `--fronts auto` (the default): none below 4 CPUs, where the front would only take a core from
  the decoders and the jobs; then one per 16 CPUs, at most 4.

Modules: front.py is the front process (it imports grpc and the wire, nothing of the books);
relay.py is joaderd's side of one front's link; fronts.py starts, watches and stops them.
"""
