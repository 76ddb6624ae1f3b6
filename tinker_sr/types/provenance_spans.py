"""Provenance spans: which sampled sequence each datum position came from."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PromptProvenanceSpan", "SampledProvenanceSpan", "ProvenanceSpans"]


def _check_span(kind: str, sequence_id: str, offset: int, length: int) -> None:
    if length < 0:
        raise ValueError(f"{kind}.length must be >= 0, got {length}")
    if not sequence_id:
        raise ValueError(f"{kind}.sequence_id must be non-empty")
    if offset < 0:
        raise ValueError(f"{kind}.offset must be >= 0, got {offset}")


@dataclass(frozen=True, kw_only=True)
class PromptProvenanceSpan:
    """Claims that the covered datum positions are tokens ``[offset, offset + length)`` of the
    prompt sent in the sampling request that returned ``sequence_id``."""

    sequence_id: str
    offset: int = 0
    length: int

    def __post_init__(self) -> None:
        _check_span("PromptProvenanceSpan", self.sequence_id, self.offset, self.length)


@dataclass(frozen=True, kw_only=True)
class SampledProvenanceSpan:
    """Claims that the covered datum positions are sampled tokens ``[offset, offset + length)``
    of sequence ``sequence_id``."""

    sequence_id: str
    offset: int = 0
    length: int

    def __post_init__(self) -> None:
        _check_span("SampledProvenanceSpan", self.sequence_id, self.offset, self.length)


ProvenanceSpans = list[PromptProvenanceSpan | SampledProvenanceSpan]
