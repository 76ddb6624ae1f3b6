"""The size limits of one engine, in one place, the same for every way of reaching it.

`LocalBackend(limits=...)` holds them; `tinker-sr serve` builds them from its flags (one per
field: ``--max-lora-rank``, ``--max-num-samples``, ``--max-sample-tokens``,
``--max-train-tokens``, ``--max-seq-ahead``, ``--max-body-bytes``), so a request refused by the embedded engine is refused by the server
with the same message, and vice versa. Each check raises `EngineUserError` naming the field,
the limit and the fix. docs/reliability.md lists them. Torch-free: `tinker_sr.validation`
and the clients use it without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tinker_sr.user_errors import EngineUserError

__all__ = ["DEFAULT_LIMITS", "Limits"]


def _limit(default: int, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Limits:
    """Each field is also a ``tinker-sr serve`` flag: ``--max-lora-rank`` etc."""

    max_lora_rank: int = _limit(512, "largest LoRA rank a training client may ask for")
    max_num_samples: int = _limit(4096, "most sequences one sample request may ask for")
    max_sample_tokens: int = _limit(
        1 << 18,
        "most num_samples x (prompt + max_tokens) tokens in one sample request (its KV cache "
        "and outputs grow with this: 262,144 tokens is 4 GiB of KV cache on tinker-sr/small)",
    )
    max_train_tokens: int = _limit(
        1 << 20, "most tokens over all datums of one forward/forward_backward request"
    )
    max_seq_ahead: int = _limit(
        1024,
        "how far a training request's seq_id may run ahead of the next one to execute (a "
        "request further ahead could only wait forever for the ones in between)",
    )
    max_body_bytes: int = _limit(
        64 * 1024 * 1024,
        "largest HTTP request body the server reads (the embedded engine has no bodies; the "
        "token limits bound its work)",
    )

    @staticmethod
    def help(name: str) -> str:
        return str(_FIELDS[name].metadata["help"])

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{f.name} must be an integer >= 1, got {value!r}")

    def check_lora_rank(self, rank: int) -> None:
        if rank > self.max_lora_rank:
            raise EngineUserError(
                f"lora_config.rank: {rank} is above this engine's limit of {self.max_lora_rank} "
                "(--max-lora-rank / Limits.max_lora_rank); use a smaller rank"
            )

    def check_num_samples(self, num_samples: int) -> None:
        if not 1 <= num_samples <= self.max_num_samples:
            raise EngineUserError(
                f"num_samples must be in 1..{self.max_num_samples} (--max-num-samples / "
                f"Limits.max_num_samples), got {num_samples}; split the request"
            )

    def check_sample_tokens(self, num_samples: int, prompt_len: int, max_tokens: int) -> None:
        tokens = num_samples * (prompt_len + max_tokens)
        if tokens > self.max_sample_tokens:
            raise EngineUserError(
                f"num_samples x (prompt + max_tokens) = {num_samples} x ({prompt_len} + "
                f"{max_tokens}) = {tokens} tokens, above this engine's limit of "
                f"{self.max_sample_tokens} (--max-sample-tokens / Limits.max_sample_tokens); "
                "ask for fewer samples per request or fewer max_tokens"
            )

    def check_train_tokens(self, tokens: int) -> None:
        if tokens > self.max_train_tokens:
            raise EngineUserError(
                f"data: {tokens} tokens in one request, above this engine's limit of "
                f"{self.max_train_tokens} (--max-train-tokens / Limits.max_train_tokens); "
                "split the batch over several forward_backward calls before one optim_step"
            )

    def check_seq_ahead(self, model_id: str, seq_id: int, next_seq: int) -> None:
        if seq_id - next_seq > self.max_seq_ahead:
            raise EngineUserError(
                f"seq_id {seq_id} for model {model_id} is {seq_id - next_seq} ahead of the next "
                f"request to run ({next_seq}); at most {self.max_seq_ahead} may be in flight "
                "(--max-seq-ahead / Limits.max_seq_ahead). Number training requests 1, 2, 3, "
                "... per model, as the SDK clients do"
            )


_FIELDS = {f.name: f for f in fields(Limits)}
DEFAULT_LIMITS = Limits()
