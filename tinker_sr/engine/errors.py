"""Errors raised by the engine.

The engine never imports the public client types. It raises these; the backend turns
`EngineUserError` into `RequestFailedError(category=User)` (a caller mistake) and any other
exception into `RequestFailedError(category=Server)`.
"""

from __future__ import annotations


class EngineUserError(ValueError):
    """The request is wrong; the message names the field, the datum and the fix.

    A request that raises this must leave the model, optimizer, checkpoints and recorded
    sequences exactly as they were.
    """


class EngineNotFoundError(EngineUserError):
    """A named object (model, checkpoint, sampler, sequence) does not exist."""
