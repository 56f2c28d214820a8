"""The messages on a front's link to joaderd (NOTE [ Next fronts ]), each a tuple framed by
`joader.server.wire`; the first element says which.

front -> joaderd: (READY, address, pid) once the front listens; (NEXT, call_id, request bytes);
(CANCEL, call_id) when the client went away before its reply.
joaderd -> front: (REPLY, call_id, reply bytes); (ERROR, call_id, status code name, the joader
error's class name or None, details).
"""

from __future__ import annotations

READY = 0
NEXT = 1
CANCEL = 2
REPLY = 3
ERROR = 4
