"""joader's client side: `JoaderDataset`, the lease keeper, the channel helpers; the `joader`
command and the demo in `joader.client.tools`.

Installed as `joader.client`. It talks to joaderd over gRPC and reads pixels from the server's
shared-memory arena; it never imports the server.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JoaderDataLoader", "JoaderDataset"]


def __getattr__(name: str) -> Any:
    if name == "JoaderDataset":
        from joader.client.dataset import JoaderDataset

        return JoaderDataset
    if name == "JoaderDataLoader":
        from joader.client.loader import JoaderDataLoader

        return JoaderDataLoader
    raise AttributeError(f"module 'joader.client' has no attribute {name!r}")
