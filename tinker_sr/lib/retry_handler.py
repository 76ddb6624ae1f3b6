"""Retry configuration for sampling requests (``tinker.lib.retry_handler.RetryConfig``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from tinker_sr.errors import APIConnectionError

__all__ = ["RetryConfig", "RetryableException", "is_retryable_status_code"]


class RetryableException(Exception):
    """Raised internally when a request must be resubmitted (e.g. its result expired)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def is_retryable_status_code(status_code: int) -> bool:
    """408, 409, 429 and 5xx are transient; any other status is final."""
    return status_code in (408, 409, 429) or 500 <= status_code < 600


@dataclass
class RetryConfig:
    """How sampling requests are limited and retried.

    Not frozen (as in the official SDK) but hashable, because clients cache per config.
    """

    max_connections: int | None = 1000
    """Concurrent requests allowed; ``None`` disables the limit. The server may lower it."""

    progress_timeout: float = 120 * 60
    """Seconds without any request finishing before requests count as stuck."""

    retry_delay_base: float = 0.5
    """First retry delay in seconds; doubles per attempt."""

    retry_delay_max: float = 10.0
    """Upper bound on one retry delay, in seconds."""

    jitter_factor: float = 0.25
    """Random spread (fraction of the delay) added to each retry delay."""

    enable_retry_logic: bool = True

    enable_stuck_detection: bool = True
    """Fail with ``APIConnectionError("...Requests appear to be stuck.")`` after
    ``progress_timeout`` seconds without progress; otherwise wait forever."""

    retryable_exceptions: tuple[type[Exception], ...] = (
        asyncio.TimeoutError,
        APIConnectionError,
        httpx.TimeoutException,
        RetryableException,
    )

    def __post_init__(self) -> None:
        if self.max_connections is not None and self.max_connections <= 0:
            raise ValueError(f"max_connections must be positive, got {self.max_connections}")

    def __hash__(self) -> int:
        return hash(
            (
                self.max_connections,
                self.progress_timeout,
                self.retry_delay_base,
                self.retry_delay_max,
                self.jitter_factor,
                self.enable_retry_logic,
                self.enable_stuck_detection,
                self.retryable_exceptions,
            )
        )
