"""Usage accounting: what each session trained on, prefilled, sampled and saved, in UTC-hour
buckets, the quantities Tinker bills (`AdminClient.get_billing_usage`, ``tinker billing
usage``), and the checkpoint storage a store holds now
(`AdminClient.get_current_checkpoint_storage_usage`).

Counted by the engine where the work is done, once it succeeded (a refused or failed request
counts nothing), so the embedded backend and ``tinker-sr serve`` count the same (in the
store's SQLite file: it survives restarts):

* ``training``: the tokens of every datum's ``model_input`` in `forward_backward` and
  `forward`;
* ``sampling_prefill``: a sample request's prompt tokens (once per request, whatever
  ``num_samples``), split into those computed and those the prompt cache served (``cached``);
  `compute_logprobs` is a sample request too;
* ``sampling_sample``: the tokens generated, summed over the request's sequences;
* ``checkpoint``: checkpoints written by name (`save_state`, `save_weights_for_sampler(name)`).

Prices: none by default (a local engine bills nothing: ``estimated_cost_usd`` is null). A
`RateCard` (a JSON file: ``LocalBackend(rate_card=...)``, ``tinker-sr serve --rate-card``
or ``$TINKER_SR_RATE_CARD``) prices the tokens and the storage, e.g. at a hosted service's
published rates, to see what a run would cost there.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tinker_sr import types
from tinker_sr.user_errors import EngineUserError

HOUR_S = 3600
MAX_WINDOW = timedelta(days=14)
GB = 10**9  # the storage unit (decimal gigabytes, as storage is billed)
MAX_RATE = 1e9  # USD per unit: above it a cost can overflow to inf (not JSON)

TRAINING = "training"
PREFILL = "sampling_prefill"
PREFILL_CACHED = "sampling_prefill_cached"  # stored apart; a `sampling_prefill` event, cached
SAMPLE = "sampling_sample"
CHECKPOINT = "checkpoint"
TOKEN_KINDS = (TRAINING, PREFILL, PREFILL_CACHED, SAMPLE)
STORAGE_RATE = "storage_gb_month"
_RATE_KEYS = (*TOKEN_KINDS, STORAGE_RATE)


def hour_bucket(t: float) -> int:
    """The start (epoch seconds) of the UTC hour holding time ``t``."""
    return int(t // HOUR_S) * HOUR_S


def sample_counts(
    prompt_tokens: int, response: types.SampleResponse, *, prompt_recomputed: bool = False
) -> dict[str, int]:
    """What one answered sample request used: its prompt, computed or served by the prompt
    cache (none of it when ``prompt_recomputed``: prompt log-probs ran a forward over all of
    it), and every token its sequences generated."""
    cached = 0 if prompt_recomputed else min(int(response.prompt_cache_hit_tokens), prompt_tokens)
    return {
        PREFILL: prompt_tokens - cached,
        PREFILL_CACHED: cached,
        SAMPLE: sum(len(s.tokens) for s in response.sequences),
    }


# ---- the request's window ---------------------------------------------------------------
def utc_time(value: Any, field: str) -> datetime:
    """``value`` (a datetime or an RFC 3339 string) in UTC; a time without a zone is UTC."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise EngineUserError(
                f"{field} must be an RFC 3339 time such as '2026-07-13T00:00:00Z', got {value!r:.60}"
            ) from None
    if not isinstance(value, datetime):
        raise EngineUserError(
            f"{field} must be a datetime or an RFC 3339 string, got {type(value).__name__}"
        )
    # A time without a zone is read as UTC (the buckets are UTC hours).
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:  # year 1 east of UTC, year 9999 west of it
        raise EngineUserError(f"{field} is out of range: {value.isoformat()}") from None


def check_window(starting_on: Any, ending_before: Any, now: float) -> tuple[int, int]:
    """The usage window as epoch seconds ``[start, end)``, held to the rules Tinker states for
    ``GET /api/v1/billing/usage/events``: both ends on a UTC hour, the start not in the
    future, the end after the start and at most 14 days later."""
    start = utc_time(starting_on, "starting_on")
    end = utc_time(ending_before, "ending_before")
    for field, t in (("starting_on", start), ("ending_before", end)):
        if (t.minute, t.second, t.microsecond) != (0, 0, 0):
            raise EngineUserError(
                f"{field} must be on a UTC hour boundary (e.g. "
                f"{t.replace(minute=0, second=0, microsecond=0).isoformat()}), got {t.isoformat()}"
            )
    if start.timestamp() > now:
        raise EngineUserError(f"starting_on must not be in the future, got {start.isoformat()}")
    if end <= start:
        raise EngineUserError(
            f"ending_before ({end.isoformat()}) must be after starting_on ({start.isoformat()})"
        )
    if end - start > MAX_WINDOW:
        raise EngineUserError(
            f"the window may span at most 14 days; {start.isoformat()} to {end.isoformat()} "
            "spans more: ask for it in parts"
        )
    return int(start.timestamp()), int(end.timestamp())


# ---- prices -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RateCard:
    """USD prices per base model (``"*"``: every other model): per million tokens of each
    token kind, and per GB-month of checkpoint storage. A kind without a price is left
    unpriced (null), as Tinker leaves a row it cannot price."""

    models: Mapping[str, Mapping[str, float]]

    def rate(self, base_model: str | None, kind: str) -> float | None:
        for name in (base_model, "*"):
            prices = self.models.get(name) if name is not None else None
            if prices is not None and kind in prices:
                return prices[kind]
        return None

    def token_cost(self, base_model: str, kind: str, tokens: int) -> tuple[float, float] | None:
        """(USD per million tokens, USD) of ``tokens`` of ``kind`` on ``base_model``; None
        where the card does not price them (a checkpoint, a kind without a price)."""
        rate = self.rate(base_model, kind) if kind in TOKEN_KINDS else None
        return None if rate is None else (rate, rate * tokens / 1e6)

    @classmethod
    def resolve(cls, card: str | Path | RateCard | None) -> RateCard | None:
        """``card`` itself, read from its file, or (None) from ``$TINKER_SR_RATE_CARD``'s."""
        card = card or os.environ.get("TINKER_SR_RATE_CARD") or None
        return card if isinstance(card, RateCard | None) else cls.load(card)

    @classmethod
    def load(cls, path: str | Path) -> RateCard:
        """Read a rate card: ``{"*": {"training": 0.4, ...}, "Qwen/Qwen3-8B": {...}}`` with
        the keys ``training``, ``sampling_prefill``, ``sampling_prefill_cached``,
        ``sampling_sample`` (USD per million tokens) and ``storage_gb_month``."""
        where = f"rate card {path}"
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise EngineUserError(f"{where}: cannot be read ({e.strerror or e})") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise EngineUserError(f"{where}: not JSON ({e})") from None
        except RecursionError:
            raise EngineUserError(f"{where}: not a rate card (JSON nested too deeply)") from None
        return cls.parse(raw, where)

    @classmethod
    def parse(cls, raw: Any, where: str = "rate card") -> RateCard:
        if not isinstance(raw, dict) or not raw:
            raise EngineUserError(
                f'{where}: must be a JSON object of models, e.g. {{"*": {{"training": 0.4}}}}'
            )
        models: dict[str, dict[str, float]] = {}
        for model, prices in raw.items():
            if not isinstance(prices, dict):
                raise EngineUserError(f"{where}: [{model!r}] must be an object of prices")
            for key, value in prices.items():
                if key == STORAGE_RATE and model != "*":
                    raise EngineUserError(
                        f"{where}: [{model!r}] prices {STORAGE_RATE}, which only '*' may: "
                        "storage is priced once, whatever the model"
                    )
                if key not in _RATE_KEYS:
                    raise EngineUserError(
                        f"{where}: [{model!r}] has unknown key {key!r}; the keys are "
                        + ", ".join(_RATE_KEYS)
                    )
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int | float)
                    or not math.isfinite(value)
                    or not 0 <= value <= MAX_RATE
                ):
                    raise EngineUserError(
                        f"{where}: [{model!r}][{key!r}] must be a non-negative number of USD (at "
                        f"most {MAX_RATE:g}), got {value!r:.40}"
                    )
            models[str(model)] = {k: float(v) for k, v in prices.items()}
        return cls(models)


# ---- responses --------------------------------------------------------------------------
@dataclass(frozen=True)
class UsageRow:
    """One stored bucket: a session's quantity of one kind on one base model in one hour."""

    bucket_start: int
    session_id: str
    base_model: str
    kind: str
    quantity: int


def _event_info(kind: str, quantity: int) -> types.BillingEventInfo:
    if kind == TRAINING:
        return types.TrainingBillingEvent(token_count=quantity)
    if kind in (PREFILL, PREFILL_CACHED):
        return types.SamplingPrefillBillingEvent(
            cached=kind == PREFILL_CACHED, token_count=quantity
        )
    if kind == SAMPLE:
        return types.SamplingSampleBillingEvent(token_count=quantity)
    return types.CheckpointBillingEvent(count=quantity)


def event_kind(info: Any) -> str:
    """The stored kind of a billing event's ``event_info`` (`_event_info` read back; a cached
    prefill is `PREFILL_CACHED`), from either SDK's types."""
    return PREFILL_CACHED if info.type == PREFILL and info.cached else str(info.type)


def billing_response(
    rows: Sequence[UsageRow],
    sessions: Mapping[str, tuple[dict[str, str] | None, str | None]],
    rates: RateCard | None,
) -> types.BillingUsageResponse:
    """The rows as Tinker's hourly events, ordered by bucket, then by quantity, largest
    first; ``sessions`` maps a session id to its (user_metadata, project_id)."""
    events = []
    for r in sorted(rows, key=lambda r: (r.bucket_start, -r.quantity, r.kind, r.session_id)):
        priced = rates.token_cost(r.base_model, r.kind, r.quantity) if rates else None
        start = datetime.fromtimestamp(r.bucket_start, UTC)
        events.append(
            types.BillingUsageEvent(
                bucket_start=start,
                bucket_end=start + timedelta(seconds=HOUR_S),
                base_model=r.base_model,
                session_id=r.session_id,
                project_id=sessions.get(r.session_id, (None, None))[1],
                estimated_cost_usd=None if priced is None else priced[1],
                effective_rate_usd_per_million_tokens=None if priced is None else priced[0],
                event_info=_event_info(r.kind, r.quantity),
            )
        )
    seen = {r.session_id for r in rows}
    return types.BillingUsageResponse(
        data=events,
        sessions={
            s: types.BillingUsageSession(user_metadata=sessions.get(s, (None, None))[0])
            for s in sorted(seen)
        },
    )


def storage_response(
    checkpoints: Iterable[tuple[str | None, str | None, int]],
    rates: RateCard | None,
    project_id: str | None = None,
) -> types.CurrentCheckpointStorageUsageResponse:
    """Current checkpoint storage, one item per project: ``checkpoints`` are
    (session_id, project_id, size_bytes) of the live checkpoints."""
    per_project: dict[str | None, list[int]] = {}
    for _session, project, size in checkpoints:
        if project_id is None or project == project_id:
            per_project.setdefault(project, []).append(size)
    rate = rates.rate(None, STORAGE_RATE) if rates else None
    items = []
    for project in sorted(per_project, key=lambda p: (p is not None, p or "")):
        size = sum(per_project[project])
        gigabytes = size / GB
        items.append(
            types.CurrentCheckpointStorageUsageItem(
                project_id=project,
                checkpoint_count=len(per_project[project]),
                size_bytes=size,
                size_gigabytes=gigabytes,
                estimated_monthly_cost_usd=None if rate is None else rate * gigabytes,
            )
        )
    return types.CurrentCheckpointStorageUsageResponse(
        effective_rate_usd_per_gigabyte_month=rate, data=items
    )


def only(sessions: Collection[str] | None, session_id: str | None) -> bool:
    """Whether a row of ``session_id`` is visible to a caller limited to ``sessions``
    (None: every session, the embedded engine's own caller)."""
    return sessions is None or (session_id is not None and session_id in sessions)
