"""The Next reply's repeated fields (server/service.py `_response`): built from whole lists when
a batch's items share a shape and dtype (issue 37), the same message as the per-item loop it
replaced, which is kept here as the model."""

from __future__ import annotations

import random

from joader.proto import DTYPE_CODES, joader_pb2
from joader.server.registry.next_call import Batch
from joader.server.service import _response


def _model(batch: Batch) -> tuple[list[int], list[int], list[int]]:
    dims: list[int] = []
    for _, shape, _ in batch.forms:
        dims.extend(shape)
    return dims, [len(shape) for _, shape, _ in batch.forms], [DTYPE_CODES[d] for _, _, d in batch.forms]


def test_repeated_fields_match_the_per_item_loop() -> None:
    rng = random.Random(37)
    shapes = [(3, 8, 8), (8, 8, 3), (5,), (2, 3, 4, 5)]
    for _ in range(300):
        n = rng.randrange(0, 12)
        uniform = rng.random() < 0.5
        shape, dtype = rng.choice(shapes), rng.choice(list(DTYPE_CODES))
        batch = Batch(
            rng.randrange(1, 4), False, list(range(n)), [0] * n, list(range(0, 64 * n, 64)), [],
            forms=[(64 if uniform else rng.choice([64, 48]),
                    shape if uniform else rng.choice(shapes),
                    dtype if uniform or rng.random() < 0.5 else rng.choice(list(DTYPE_CODES))) for _ in range(n)],
            checksums=[7] * n,
        )
        reply = _response(batch, "arena")
        dims, ndims, codes = _model(batch)
        assert isinstance(reply, joader_pb2.NextResponse)
        assert (list(reply.dims), list(reply.ndims), list(reply.dtypes)) == (dims, ndims, codes)
        assert list(reply.item_ids) == batch.item_ids and list(reply.offsets) == batch.offsets
        assert list(reply.lengths) == [form[0] for form in batch.forms]
