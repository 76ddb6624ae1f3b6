"""Provenance: the one validator (engine side) and the datum builders (user side)."""

from tinker_sr.provenance.build import build_datum, build_trajectory_datum
from tinker_sr.provenance.validate import (
    RECORD_TTL_SECONDS,
    DatumSpans,
    ProvenanceView,
    SequenceLookup,
    SequenceRecord,
    touch_ids,
    validate_provenance,
)

__all__ = [
    "RECORD_TTL_SECONDS",
    "DatumSpans",
    "ProvenanceView",
    "SequenceLookup",
    "SequenceRecord",
    "build_datum",
    "build_trajectory_datum",
    "touch_ids",
    "validate_provenance",
]
