"""Shared hypothesis settings: a few hundred examples, derandomized so CI is reproducible."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "tinker_sr_fuzz",
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FUZZ = settings.get_profile("tinker_sr_fuzz")
