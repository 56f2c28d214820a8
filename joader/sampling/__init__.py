"""Sampling: which item each job receives in each round.

`DependentSampler` is DSA on the dependent sampling tree (Xie et al., NeurIPS 2022): jobs on
overlapping datasets receive the same item in as many rounds as the mathematics allows, while
each job alone still gets exactly-once, uniformly shuffled epochs. `IndependentSampler` is the
baseline, each job shuffling on its own. Both implement `Sampler`; `make_sampler` picks one by
name, the way a config file or a command line names it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from joader.errors import InvalidArgumentError
from joader.sampling.base import ORDERS, Sampler, check_order
from joader.sampling.dependent import ChainNode, DependentSampler
from joader.sampling.independent import IndependentSampler

__all__ = [
    "ORDERS",
    "SAMPLERS",
    "ChainNode",
    "DependentSampler",
    "IndependentSampler",
    "Sampler",
    "check_order",
    "make_sampler",
]

SAMPLERS: dict[str, Callable[..., Sampler]] = {
    "dependent": DependentSampler,
    "independent": IndependentSampler,
}


def make_sampler(
    name: str, seed: int | None = None, *, rng: random.Random | None = None
) -> Sampler:
    """The sampler called `name` ("dependent" or "independent"), seeded."""
    try:
        factory = SAMPLERS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown sampler {name!r}; choose one of {sorted(SAMPLERS)}"
        ) from None
    return factory(seed, rng=rng)
