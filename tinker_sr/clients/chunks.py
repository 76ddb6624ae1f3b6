"""A ``forward`` / ``forward_backward`` call in the official SDK's chunks.

The official SDK (0.38) sends a call's datums as consecutive requests of at most
``fwdbwd_max_chunk_len`` datums (1024) and ``fwdbwd_max_chunk_bytes_count`` estimated bytes
(5,000,000) each, both from the service's ``client/config``, and merges the answers: outputs
joined, each metric reduced by its suffix, a ``:mean`` averaged over the chunks weighted by
their datums (not their tokens). `TrainingClient` does the same on every backend, so a call's
metrics are the ones the official SDK reports for it, bit for bit, whether it runs embedded
or on a server, and no request outgrows a service's body limit. Gradients are the same either
way (every loss sums over tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tinker_sr import types

__all__ = ["MAX_CHUNK_BYTES", "MAX_CHUNK_DATUMS", "combine", "issue", "split"]

MAX_CHUNK_DATUMS = 1024  # the SDK's defaults (ClientConfigResponse), where a service sets none
MAX_CHUNK_BYTES = 5_000_000
_TOKEN_BYTES = 4  # the SDK's estimate: a token packs as int32, a CSR index as int64
_SPARSE_INDEX_BYTES = 8


def _input_bytes(chunk: Any) -> int:
    if isinstance(chunk, types.DmelChunk):
        return len(chunk.dmel)
    if isinstance(chunk, types.ImageChunk):
        return len(chunk.data)
    if isinstance(chunk, types.ImageAssetPointerChunk):
        return len(chunk.location)
    return int(chunk.length) * _TOKEN_BYTES


def _tensor_bytes(td: types.TensorData) -> int:
    sparse = len(td.sparse_crow_indices or ()) + len(td.sparse_col_indices or ())
    return int(td._numpy.nbytes) + _SPARSE_INDEX_BYTES * sparse


def estimated_bytes(datum: types.Datum) -> int:
    """A datum's request bytes as the official SDK estimates them to cut chunks (0 for what
    is not a Datum: the service refuses it, naming its place)."""
    if not isinstance(datum, types.Datum):
        return 0
    return sum(_input_bytes(c) for c in datum.model_input.chunks) + sum(
        _tensor_bytes(td) for td in datum.loss_fn_inputs.values()
    )


def split(
    data: Sequence[types.Datum],
    max_datums: int = MAX_CHUNK_DATUMS,
    max_bytes: int = MAX_CHUNK_BYTES,
) -> list[list[types.Datum]]:
    """``data`` in the official SDK's chunks: a chunk ends before a datum that would take it
    past ``max_bytes`` (a datum larger than that alone is a chunk), or at ``max_datums``."""
    chunks: list[list[types.Datum]] = []
    chunk: list[types.Datum] = []
    size = 0
    for datum in data:
        n = estimated_bytes(datum)
        if (chunk and size + n > max_bytes) or len(chunk) == max_datums:
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append(datum)
        size += n
    if chunk or not chunks:  # no datums: one empty request, which the service answers
        chunks.append(chunk)
    return chunks


def _limits(backend: Any) -> tuple[int, int]:
    """The service's chunk limits (a remote backend's ``client/config``), else the SDK's."""
    config = getattr(backend, "client_config", None) or {}
    return (
        int(config.get("fwdbwd_max_chunk_len", MAX_CHUNK_DATUMS)),
        int(config.get("fwdbwd_max_chunk_bytes_count", MAX_CHUNK_BYTES)),
    )


def _reduced(key: str, values: list[float], weights: list[int]) -> dict[str, Any]:
    """One metric over the chunks, as the official SDK reduces it (by its suffix; a metric of
    another suffix is left out, as there)."""
    reduction = key.split(":")[1] if key.count(":") == 1 else ""
    if reduction == "mean":
        return {key: np.average(values, weights=weights).item()}
    if reduction == "slack":
        return {key: (np.max(values) - np.average(values, weights=weights)).item()}
    if reduction == "unique":
        return {key: values[0]} | {f"{key}_{i + 1}": v for i, v in enumerate(values[1:])}
    if reduction == "hash2":
        mask = 0xFFFF_FFFF_FFFF_FFFF
        return {key: sum(int(v) & mask for v in values) & mask}
    reducers: dict[str, Callable[..., Any]] = {"sum": np.sum, "min": np.min, "max": np.max}
    reduce = reducers.get(reduction)
    return {} if reduce is None else {key: reduce(values).item()}


def combine(results: Sequence[types.ForwardBackwardOutput]) -> types.ForwardBackwardOutput:
    """The chunks' answers as one: outputs joined in order, metrics reduced (`_reduced`) over
    the keys of the first chunk that every chunk reports. Applied to one chunk too, as the
    SDK does (a ``:mean`` then goes through the weighted average: the same value, but for a
    last bit at times)."""
    weights = [len(r.loss_fn_outputs) for r in results]
    metrics: dict[str, Any] = {}
    for key in results[0].metrics:
        if all(key in r.metrics for r in results):
            metrics |= _reduced(key, [r.metrics[key] for r in results], weights)
    return types.ForwardBackwardOutput(
        loss_fn_output_type=results[0].loss_fn_output_type,
        loss_fn_outputs=[o for r in results for o in r.loss_fn_outputs],
        metrics=metrics,
    )


def issue(
    backend: Any,
    model_id: str,
    take: Callable[[int], list[int]],
    data: Sequence[types.Datum],
    loss_fn: str,
    config: Mapping[str, float | str] | None,
    *,
    forward_only: bool,
) -> Awaitable[types.ForwardBackwardOutput]:
    """Issue the call's chunks now, one sequence number each from ``take`` (called once, before
    anything is awaited: the caller may release its turn right after), and return their
    combined answer. Every chunk runs to its end; the first failure in chunk order is raised.
    Call it in the event loop."""
    chunks = split(data, *_limits(backend))
    seqs = take(len(chunks))
    calls = [
        asyncio.ensure_future(
            backend.forward_backward(model_id, s, c, loss_fn, config, forward_only=forward_only)
        )
        for s, c in zip(seqs, chunks, strict=True)
    ]

    async def combined() -> types.ForwardBackwardOutput:
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return combine(results)  # type: ignore[arg-type]

    return combined()
