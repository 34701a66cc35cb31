"""The kinds of failure every layer can raise, each with the one gRPC status it maps to.

Owns: ``FailedPrecondition`` (the call is well-formed but the service's state refuses it:
-> FAILED_PRECONDITION), ``ResourceExhausted`` (a capacity is full: -> RESOURCE_EXHAUSTED)
and ``UnknownRequest`` (a request id this process does not hold: -> INVALID_ARGUMENT).
``ValueError`` (bad fields, ConfigError, CheckpointError) also maps to INVALID_ARGUMENT;
anything else is INTERNAL. The mapping itself is ``core.wire.status_code_for``.

Must not know: which module raises them. Lower layers subclass these (``runtime.lifecycle``,
``runtime.kv_cache``) so the status map, which sits at the bottom, never imports upwards.
"""

from __future__ import annotations


class FailedPrecondition(RuntimeError):
    """The request is valid, but the service's current state refuses it."""


class ResourceExhausted(RuntimeError):
    """A capacity (slots, queue, cache length) is full."""


class UnknownRequest(KeyError):
    """A request id this process does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown request"
