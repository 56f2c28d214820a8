"""joader: share data preparation between concurrent deep-learning training jobs on one host.

The core (`joader.sampling`, `joader.cache`, `joader.sources`) is pure Python over numpy and
pyroaring. `joader.server` is the daemon, `joaderd`; `joader.client` holds `JoaderDataset`, the
client a training script uses in place of its ImageFolder, `serve`, a sweep driver's own
joaderd, and `JoaderDataLoader`, the
StatefulDataLoader whose checkpoint holds every DDP rank's state. Both are imported lazily so
that `import joader` does not pull in torch or grpc.
"""

from __future__ import annotations

from typing import Any

from joader.errors import JoaderError

__all__ = ["JoaderDataLoader", "JoaderDataset", "JoaderError", "__version__", "serve"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "JoaderDataset":
        from joader.client.dataset import JoaderDataset

        return JoaderDataset
    if name == "JoaderDataLoader":
        from joader.client.loader import JoaderDataLoader

        return JoaderDataLoader
    if name == "serve":  # a sweep's own joaderd (joader.client.autostart); no torch, no grpc
        from joader.client.autostart import serve

        return serve
    raise AttributeError(f"module 'joader' has no attribute {name!r}")
