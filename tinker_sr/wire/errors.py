"""The one error the wire codec raises."""

from __future__ import annotations

__all__ = ["WireError", "BodyTooLargeError"]


class WireError(ValueError):
    """A body does not follow the Tinker wire format.

    The message names the field (and datum) that is wrong and what was expected; the server
    answers it as HTTP 400 ``{"detail": message}``, a client raises it as a decoding error.
    """


class BodyTooLargeError(WireError):
    """A body (or its decompressed form) is larger than the configured limit (HTTP 413)."""
