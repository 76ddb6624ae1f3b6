"""Provenance: the one validator (engine side) and the datum builders (user side)."""

from tinker_sr.provenance import validate as _validate
from tinker_sr.provenance.build import build_datum, build_trajectory_datum
from tinker_sr.provenance.validate import *  # noqa: F403 (exactly validate.__all__)

__all__ = ["build_datum", "build_trajectory_datum"]
__all__ += _validate.__all__
