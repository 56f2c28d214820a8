"""The registry's shared state is declared once (server/registry/state.py), not per part."""

from __future__ import annotations

import pytest

from joader.server.registry.filing import ResultFiling
from joader.server.registry.next_protocol import NextProtocol
from joader.server.registry.registry import Registry
from joader.server.registry.scheduler_thread import SchedulerThread
from joader.server.registry.state import RegistryState

PARTS = [NextProtocol, SchedulerThread, ResultFiling]


@pytest.mark.parametrize("part", PARTS, ids=lambda part: part.__name__)
def test_each_part_is_typed_against_the_one_declaration(part: type) -> None:
    assert issubclass(part, RegistryState)
    # A part that re-declares shared attributes drifts from the one declaration unchecked.
    assert part.__dict__.get("__annotations__", {}) == {}


def test_the_registry_is_made_of_its_parts() -> None:
    assert all(issubclass(Registry, part) for part in PARTS)


def test_the_declaration_sets_nothing_at_run_time() -> None:
    # Annotations only: a name nobody sets still fails as it did before the declaration.
    declared = RegistryState.__annotations__
    assert {"config", "cache", "jobs", "_cond", "item_settled", "_contain"} <= set(declared)
    assert not any(name in vars(RegistryState) for name in declared)
