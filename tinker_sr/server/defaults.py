"""The server's defaults that ``tinker-sr``'s argument parser shows, in a module of their own:
the parser is built for every command (``tinker-sr --version`` too), and importing
`tinker_sr.server.app` for them loaded torch and the whole server first (5 s on a slow host).
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_LOGPROBS_MODE",
    "DEFAULT_LONG_POLL_S",
    "DEFAULT_SAMPLE_ABANDON_S",
    "DEFAULT_SESSION_TIMEOUT_S",
    "LOGPROBS_MODES",
]

DEFAULT_LONG_POLL_S = 25.0
"""How long ``retrieve_future`` holds a pending request before answering try_again (the
SDK's read timeout for it is 45 s)."""

DEFAULT_SESSION_TIMEOUT_S = 600.0
"""A session with no heartbeat or request for this long is finished as "interrupted"."""
DEFAULT_SAMPLE_ABANDON_S = 120.0
"""A session's sample requests are cancelled once it has had no heartbeat or request for this
long (the SDK heartbeats every 10 s and warns after 120 s without one)."""

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""What the OpenAI-compatible routes' log-probs and top-k report (`create_app`), vLLM's
``--logprobs-mode`` values: ``raw_logprobs`` (the default, as vLLM's) the model's own at every
temperature; ``processed_logprobs`` those of the distribution each token was drawn from (after
temperature, top-k, top-p; the model's own at temperature 0), which the Tinker API's sampler
always reports (but 0.0 at temperature 0)."""
DEFAULT_LOGPROBS_MODE = LOGPROBS_MODES[0]
