"""What the engine needs of a channel runtime, so the engine depends on no implementation.

The runtime (``graphflow.dist.channels.ChannelRuntime``) lives in the distributed layer,
above the engine: it listens to the engine's events. The engine takes it as a
``ChannelRuntimeProtocol`` and uses nothing else of it, so the layer below never imports
the one above, and a test or an integration can pass its own runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from graphflow.events import Event

__all__ = ["ChannelRuntimeProtocol"]


@runtime_checkable
class ChannelRuntimeProtocol(Protocol):
    """A channel runtime as the pipeline uses it.

    ``handles`` (one per channel name) is offered to the model's factory as its
    ``channels`` argument; ``bind(model)`` lets a channel's prewarm hook resolve on the
    model the factory built, and ``bind(None)`` lets go of it on rollback; ``on_event``
    receives every event, as a ``graphflow.events.Listener`` does.
    """

    handles: Mapping[str, object]

    def bind(self, model: object | None) -> None: ...

    def on_event(self, event: Event) -> None: ...
