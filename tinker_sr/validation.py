"""The one place request arguments are checked: used by the embedded backend (`LocalBackend`
and the engine modules) and by the server where it must refuse a request before it does
anything (creating a future or a session). The server has no checks of its own beyond HTTP
framing, so local, remote and official-SDK traffic get the same rules and the same messages.

Torch-free. Every failure is an `EngineUserError` naming the field and the fix; the backend
and the server turn it into a user error (HTTP 400).
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

import pydantic

from tinker_sr import types
from tinker_sr.limits import DEFAULT_LIMITS, Limits
from tinker_sr.user_errors import EngineUserError, official_sdk_hint

TTL_MIN, TTL_MAX = 3600, 10 * 365 * 24 * 3600
"""Checkpoint time-to-live bounds in seconds: 1 hour to 10 years (``None``: never expires)."""


def check_ttl(ttl_seconds: int | None) -> None:
    if ttl_seconds is not None and (
        isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, numbers.Real)
    ):
        raise EngineUserError(
            f"ttl_seconds must be a number of seconds or None, got {type(ttl_seconds).__name__} "
            f"{ttl_seconds!r:.40}"
        )
    if ttl_seconds is not None and not (TTL_MIN <= ttl_seconds <= TTL_MAX):
        raise EngineUserError(
            f"ttl_seconds must be between {TTL_MIN} (1 hour) and {TTL_MAX} (10 years), or "
            f"None for no expiry; got {ttl_seconds}"
        )


def expiry(ttl_seconds: int | None) -> float | None:
    """Expiry time for ``ttl_seconds`` (checked; ``None`` = never expires)."""
    check_ttl(ttl_seconds)
    return None if ttl_seconds is None else time.time() + ttl_seconds


EXTERNAL_URL_TTL_S = 3600
"""How long a download URL of an external-weights file is valid (ask for new ones after)."""
MAX_AGE_RECIPIENTS = 10
"""``save_weights_external`` encrypts to at most this many age recipients (as the SDK says)."""


def check_age_recipients_shape(recipients: Any) -> None:
    """``age_encryption_recipients`` is ``None`` or a list of 1 to `MAX_AGE_RECIPIENTS`
    strings (checked by clients before a request is numbered; the keys by `age_recipients`)."""
    field = "age_encryption_recipients"
    if recipients is None:
        return
    if not isinstance(recipients, list | tuple) or not recipients:
        raise EngineUserError(
            f"{field}: expected a non-empty list of age recipients (age1... keys or SSH public "
            f"keys), or None for no encryption; got {recipients!r:.80}"
        )
    if len(recipients) > MAX_AGE_RECIPIENTS:
        raise EngineUserError(
            f"{field}: at most {MAX_AGE_RECIPIENTS} recipients, got {len(recipients)}"
        )
    for i, text in enumerate(recipients):
        if not isinstance(text, str):
            raise EngineUserError(
                f"{field}[{i}]: expected a string (an age1... key or an SSH public key), got "
                f"{type(text).__name__}"
            )


def age_recipients(recipients: Any) -> list[Any]:
    """Parse ``age_encryption_recipients`` (``None``: no encryption) into pyrage recipients:
    native ``age1...`` X25519 keys or SSH public keys (``ssh-ed25519 ...``, ``ssh-rsa ...``),
    1 to `MAX_AGE_RECIPIENTS` of them. Each failure names the entry and the fix."""
    field = "age_encryption_recipients"
    check_age_recipients_shape(recipients)
    if recipients is None:
        return []
    try:
        import pyrage
    except ImportError as e:
        raise EngineUserError(
            f"{field}: encrypting an export needs the pyrage package, which is not installed "
            "here: pip install pyrage (or pip install 'tinker-sr[export]')"
        ) from e
    parsed = []
    for i, text in enumerate(recipients):
        kind = pyrage.ssh if text.startswith("ssh-") else pyrage.x25519
        try:
            parsed.append(kind.Recipient.from_str(text.strip()))
        except Exception as e:  # pyrage raises RecipientError, ValueError, TypeError...
            raise EngineUserError(
                f"{field}[{i}]: {text!r:.80} is not an age recipient ({e}); pass the public key "
                "printed by `age-keygen` (age1...) or an SSH public key (ssh-ed25519 AAAA...)"
            ) from e
    return parsed


MAX_NAME_BYTES = 200
"""A checkpoint name is a file name (plus ``.safetensors``): file systems allow 255 bytes."""


# A name is one file name, and one URL path segment as the SDKs send it: unquoted, so "?", "#"
# and "%" would end or change the path (a REST call on the checkpoint would reach another).
_NAME_FORBIDDEN = "/\\?#%"


def check_checkpoint_name(name: str) -> None:
    """1 to MAX_NAME_BYTES bytes of UTF-8 text, no separators, control characters (NUL) or
    dot-only names: a name is a file name on the server, and must stay one file name."""
    try:
        size = len(name.encode("utf-8"))
    except (UnicodeEncodeError, AttributeError):
        size = -1
    bad = (
        size < 1
        or size > MAX_NAME_BYTES
        or name in (".", "..")
        or any(c in _NAME_FORBIDDEN or ord(c) < 32 or ord(c) == 127 for c in name)
    )
    if bad:
        raise EngineUserError(
            f"checkpoint name {name!r:.60} is invalid: use 1-{MAX_NAME_BYTES} bytes of UTF-8 "
            "text without '/', '\\', '?', '#', '%' or control characters (such as NUL), not "
            "'.' or '..'"
        )


def checkpoint_path(path: str, field: str = "path") -> types.ParsedCheckpointTinkerPath:
    """``path`` parsed as a checkpoint's; a malformed one is refused naming ``field`` (the
    server and the embedded engine refuse it alike, before accepting the request)."""
    try:
        return types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError:
        raise EngineUserError(
            f"{field} {path!r} is not a checkpoint path; expected "
            "tinker://<run_id>/<weights|sampler_weights>/<name>"
        ) from None


def check_model_seq_id(model_seq_id: int, what: str) -> None:
    if model_seq_id < 0:
        raise EngineUserError(f"{what}: model_seq_id must be >= 0, got {model_seq_id}")


def check_no_access_token(token: str | None, what: str) -> None:
    if token is not None:
        raise EngineUserError(
            f"{what}: weights_access_token is not supported: tinker_sr has no cross-account "
            "access; copy or load your own checkpoints, or ones their owner published on a "
            "server (omit the token)"
        )


def check_copy_weights(
    *,
    session_id: str | None,
    model_seq_id: int | None,
    destination_project_id: str | None,
    ttl_seconds: int | None,
    weights_access_token: str | None,
) -> None:
    """The arguments of `Backend.copy_weights` (the source path is checked by its lookup)."""
    check_no_access_token(weights_access_token, "copy_weights")
    if (session_id is None) != (model_seq_id is None):
        raise EngineUserError(
            "copy_weights: pass session_id and model_seq_id together (copy into that "
            "training-run slot), or neither (copy into a new session, of "
            "destination_project_id if given)"
        )
    if session_id is not None and destination_project_id is not None:
        raise EngineUserError(
            "copy_weights: pass session_id + model_seq_id or destination_project_id, not both"
        )
    if model_seq_id is not None:
        check_model_seq_id(model_seq_id, "copy_weights")
    if destination_project_id is not None:  # the new session's project_id
        check_label(destination_project_id, "copy_weights: destination_project_id")
    check_ttl(ttl_seconds)


def check_paging(limit: object, offset: object, what: str = "list") -> None:
    """``limit`` and ``offset`` of a listing: integers below 10**9, as a server's query
    parameters (SQLite would take a negative LIMIT as "no limit")."""
    for name, value in (("limit", limit), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 10**9:
            raise EngineUserError(
                f"{what}: {name} must be an integer from 0 to 999999999, got {value!r:.40}"
            )


def check_num_samples(num_samples: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """1 to ``limits.max_num_samples`` (the server checks it before it lists sequence ids)."""
    limits.check_num_samples(num_samples)


def sequence_ids(sampler_id: str, seq_id: int, num_samples: int, tag: str) -> list[str]:
    """Ids of a sample request's sequences: unique within the session, since the sampler id
    is, and ``tag`` (random, or from the request id) differs between requests."""
    return [f"{sampler_id}:{seq_id}:{i}:{tag}" for i in range(num_samples)]


def require_lora_config(cfg: types.LoraConfig | None) -> types.LoraConfig:
    if cfg is None:
        raise EngineUserError(
            "create_model: lora_config is required; this engine trains LoRA adapters only "
            "(pass rank=...)"
        )
    return cfg


def check_lora_config(cfg: types.LoraConfig | None) -> types.LoraConfig:
    """A LoRA config the engine can train: rank >= 1 and at least one target."""
    cfg = require_lora_config(cfg)
    if cfg.rank < 1:
        raise EngineUserError(f"lora_config.rank must be >= 1, got {cfg.rank}")
    if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
        raise EngineUserError(
            "lora_config: at least one of train_attn/train_mlp/train_unembed must be true"
        )
    return cfg


def check_optimizer_config(cfg: Any) -> None:
    kind = getattr(cfg, "type", "adamw") if cfg is not None else "adamw"
    if kind != "adamw":
        raise EngineUserError(
            f"optimizer {kind!r} is not supported by the tinker_sr engine; use AdamOptimizerConfig()"
        )


# What a server refuses (400) before it accepts a numbered training request; the embedded engine
# refuses the same the same way (`LocalBackend._refuse_numbered`), so both paths raise alike.
EMPTY_LOSS_FN = "forward_backward: loss_fn is empty; name a loss such as 'cross_entropy'"
EMPTY_SAVE_PATH = "save_weights: path (the checkpoint name) is required"


_INT32 = (-(2**31), 2**31 - 1)


def check_token_ids(data: Any) -> None:
    """Every model_input token id of a forward(_backward) request fits the wire's int32, checked
    before the request is numbered (a remote request that failed to encode would leave a gap in
    the model's seq_ids); the vocabulary check is the backend's. OverflowError, as the SDK."""
    for i, datum in enumerate(data):
        for chunk in getattr(getattr(datum, "model_input", None), "chunks", None) or ():
            tokens = getattr(chunk, "tokens", None)
            if not tokens or not isinstance(tokens, list | tuple):
                continue
            low, high = min(tokens), max(tokens)
            if low < _INT32[0] or high > _INT32[1]:
                bad = high if high > _INT32[1] else low
                raise OverflowError(
                    f"data[{i}].model_input token id {bad} does not fit int32 (how the wire "
                    "carries token ids); token ids index the vocabulary: 0 <= id < vocab size"
                )


def non_finite(params: Any, where: str) -> str | None:
    """The first NaN or infinite number field of request parameters (`AdamParams`,
    `SamplingParams`), which JSON cannot carry: ``"<where>.<field> is nan; pass ..."``."""
    for k, v in (params.model_dump() if isinstance(params, pydantic.BaseModel) else {}).items():
        if isinstance(v, float) and not math.isfinite(v):
            return f"{where}.{k} is {v}; pass a finite number"
    return None


def unsupported_optimizer(params: Any) -> str | None:
    """Why an optim_step's parameters are refused: every model here steps with AdamW, so other
    `OptimParams` (e.g. `DimuonParams`) are refused by name, as the server refuses them."""
    if isinstance(params, types.AdamParams):
        return None
    return optimizer_refused(getattr(params, "type", type(params).__name__))


def optimizer_refused(kind: object) -> str:
    return (
        f"optim_step: optimizer_params of type {kind!r} are not supported; this server steps "
        "with AdamW (send adam_params)"
    )


def adam_values(p: Any) -> dict[str, float]:
    """The checked hyperparameters of an optim_step's `AdamParams`."""
    if not isinstance(p, types.AdamParams):
        raise EngineUserError(
            f"this model uses AdamW; optim_step needs AdamParams, got {type(p).__name__}"
        )
    vals = {
        "learning_rate": p.learning_rate,
        "beta1": p.beta1,
        "beta2": p.beta2,
        "eps": p.eps,
        "weight_decay": p.weight_decay,
        "grad_clip_norm": p.grad_clip_norm,
    }
    problem = non_finite(p, "AdamParams")  # as a backend refuses it before numbering
    if problem is not None:
        raise EngineUserError(problem)
    if p.learning_rate < 0:
        raise EngineUserError(f"AdamParams.learning_rate must be >= 0, got {p.learning_rate}")
    for k in ("beta1", "beta2"):
        if not 0 <= vals[k] < 1:
            raise EngineUserError(f"AdamParams.{k} must be in [0, 1), got {vals[k]}")
    if p.eps <= 0:
        raise EngineUserError(f"AdamParams.eps must be > 0, got {p.eps}")
    for k in ("weight_decay", "grad_clip_norm"):
        if vals[k] < 0:
            raise EngineUserError(f"AdamParams.{k} must be >= 0 (0 turns it off), got {vals[k]}")
    return vals


def check_text(value: object, field: str) -> None:
    """Every string in ``value`` (itself, or the keys, values and items of the dicts, lists
    and tuples in it) is text UTF-8 can carry: a lone surrogate (e.g. from a bad
    ``surrogateescape`` decode) cannot be sent or stored. Clients check before a request is
    numbered, so a refused one leaves no gap in the model's seq_ids."""
    stack: list[tuple[str, object]] = [(field, value)]
    seen: set[int] = set()  # containers already walked (a list may hold itself)
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict | list | tuple):
            if id(v) in seen:
                continue
            seen.add(id(v))
        if isinstance(v, str):
            if v.isascii():
                continue
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = e.object[e.start : e.end]
                raise EngineUserError(
                    f"{where} = {v!r:.60} holds {bad!r}, a lone surrogate that UTF-8 cannot "
                    "encode; pass valid text (decode bytes with errors='replace')"
                ) from None
        elif isinstance(v, dict):
            stack.extend((f"{where} key {k!r:.40}", k) for k in v)
            stack.extend((f"{where}[{k!r:.40}]", x) for k, x in v.items())
        elif isinstance(v, list | tuple):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))


def check_user_metadata(metadata: object, what: str) -> None:
    """``user_metadata`` is a str -> str mapping, as the official SDK types it everywhere it is
    read back (runs, checkpoints, sessions): anything else would break those listings."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise EngineUserError(
            f"{what}: user_metadata must be a dict of str -> str, got {type(metadata).__name__}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise EngineUserError(
                f"{what}: user_metadata[{key!r}] = {value!r:.40}: keys and values must be "
                "strings; convert them, e.g. with str() or json.dumps()"
            )
    size = sum(len(k) + len(v) for k, v in metadata.items())
    if size > MAX_METADATA_CHARS:
        raise EngineUserError(
            f"{what}: user_metadata holds {size} characters, over the {MAX_METADATA_CHARS} kept "
            "with a run, session or checkpoint (it is stored and listed with it); keep large "
            "data in your own files and put their names here"
        )
    check_text(metadata, f"{what}: user_metadata")


# What a session, run or checkpoint keeps of its caller's free text (stored with it, and read
# back by every listing): far above what the SDK's and cookbook's callers send.
MAX_METADATA_CHARS = 65536
MAX_LABEL_CHARS = 1024  # project_id, display_name, one tag
MAX_TAGS = 256


def check_session_fields(
    user_metadata: object, project_id: object, display_name: object, tags: object
) -> list[str]:
    """A new session's caller-given fields, checked; its tags, deduplicated in order."""
    check_user_metadata(user_metadata, "create_session")
    for name, value in (("project_id", project_id), ("display_name", display_name)):
        if value is not None:
            check_label(value, f"create_session: {name}")
    return check_tags(tags)


def check_label(value: object, where: str) -> None:
    if not isinstance(value, str):
        raise EngineUserError(f"{where} must be a str, got {value!r:.40}")
    if len(value) > MAX_LABEL_CHARS:
        raise EngineUserError(
            f"{where} is {len(value)} characters long, over the {MAX_LABEL_CHARS} kept; "
            "shorten it (put longer notes in user_metadata)"
        )
    check_text(value, where)


def check_tags(tags: object) -> list[str]:
    """Session ``tags``: a list of strings (kept with the session), deduplicated in order."""
    if isinstance(tags, str) or not isinstance(tags, list | tuple):
        raise EngineUserError(f"create_session: tags must be a list of str, got {tags!r:.40}")
    for tag in tags:
        check_label(tag, f"create_session: tag {tag!r:.40}")
    unique = list(dict.fromkeys(tags))
    if len(unique) > MAX_TAGS:
        raise EngineUserError(
            f"create_session: {len(unique)} tags, over the {MAX_TAGS} kept with a session"
        )
    return unique


INFLIGHT_UNSUPPORTED = (
    "kind 'inflight' (samplers that follow later weight updates) is not supported; use the "
    "default kind 'snapshot'"
)


def check_sampler_kind(kind: str, what: str) -> None:
    """Only ``"snapshot"`` samplers exist here; refused alike by clients and server."""
    if kind == "inflight":
        raise EngineUserError(f"{what}: {INFLIGHT_UNSUPPORTED}")


def check_forward_request(data: list[types.Datum], loss_fn: object, config: object) -> None:
    """The strings and token ids of a forward(_backward) request encode (`validation`), checked
    before it is numbered; datum keys are almost always ASCII, so this costs one test each."""
    check_text(loss_fn, "loss_fn")
    check_text(config, "loss_fn_config")
    for i, datum in enumerate(data):  # before the wire encodes one, as it cannot
        if hint := official_sdk_hint(datum):
            raise TypeError(f"data[{i}] must be a Datum, got {type(datum).__name__}{hint}")
    check_token_ids(data)
    for i, datum in enumerate(data):
        inputs = getattr(datum, "loss_fn_inputs", None)  # not a Datum: the backend says so
        for key in inputs if isinstance(inputs, dict) else ():
            if isinstance(key, str) and not key.isascii():
                check_text(key, f"data[{i}].loss_fn_inputs key")
