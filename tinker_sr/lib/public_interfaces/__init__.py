"""Public client-facing interfaces (mirrors ``tinker.lib.public_interfaces``)."""

from tinker_sr.futures import APIFuture, AwaitableConcurrentFuture

__all__ = ["APIFuture", "AwaitableConcurrentFuture"]
