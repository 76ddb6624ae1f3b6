"""Seeds for what a client left unseeded, drawn from one seed: a server for tests (`mock_tinker`,
`tinker_server_process`) makes code that seeds nothing repeat bit for bit.

A LoRA client created without ``seed`` and a sample without ``SamplingParams.seed`` otherwise
draw from the OS (as the hosted service does), so such code (tinker-cookbook 0.6.1's completers
seed no sample) ran offline but differently each time. Each seed is a hash of the server's
seed and what names the request in the client's own order, never the server's random ids or
the order requests arrive in: the session's place among the sessions created, then the
``model_seq_id``, or the sampler's ``sampling_session_seq_id`` and the sample's ``seq_id``.
Two samples of one prompt still differ (their ``seq_id``s do); so do the rows of one sample.
"""

from __future__ import annotations

import hashlib
import threading


class UnseededSeeds:
    """The seeds of one server's unseeded requests (see the module docstring)."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._lock = threading.Lock()
        self._sessions: dict[str, int] = {}
        self._samplers: dict[str, tuple[int, int]] = {}

    def session(self, session_id: str) -> None:
        """A session was created: its place in creation order."""
        with self._lock:
            self._sessions.setdefault(session_id, len(self._sessions))

    def sampler(self, sampler_id: str, session_id: str, sampling_session_seq_id: int) -> None:
        with self._lock:
            place = self._sessions.get(session_id, -1)
            self._samplers[sampler_id] = (place, int(sampling_session_seq_id))

    def lora(self, session_id: str, model_seq_id: int) -> int:
        return self._draw("lora", self._sessions.get(session_id, -1), int(model_seq_id))

    def sample(self, sampler_id: str, seq_id: int) -> int:
        place, sampler = self._samplers.get(sampler_id, (-1, -1))
        return self._draw("sample", place, sampler, int(seq_id))

    def _draw(self, *names: object) -> int:
        text = "|".join(str(n) for n in (self.seed, *names)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1
