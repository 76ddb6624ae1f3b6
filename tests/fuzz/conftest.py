"""Shared hypothesis settings: 120 examples by default, derandomized so CI is reproducible
(CI draws the same examples every run, so more of them there guard little more; the suite's
time budget went to tests of new behaviour).

For a longer, randomized campaign (new examples every run; what CI's fixed seed never draws):

    TINKER_SR_FUZZ_EXAMPLES=5000 TINKER_SR_FUZZ_RANDOM=1 python -m pytest -q tests/fuzz

A failure prints hypothesis' falsifying example; add it to the test's edge values.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

DEFAULT_EXAMPLES = 120
BASE_EXAMPLES = 200  # what each test's own count in `scaled` is relative to


def _examples() -> int:
    raw = os.environ.get("TINKER_SR_FUZZ_EXAMPLES", str(DEFAULT_EXAMPLES))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TINKER_SR_FUZZ_EXAMPLES={raw!r}: use a positive integer, e.g. 5000")
    return int(raw)


settings.register_profile(
    "tinker_sr_fuzz",
    max_examples=_examples(),
    deadline=None,
    derandomize=os.environ.get("TINKER_SR_FUZZ_RANDOM", "") in ("", "0"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FUZZ = settings.get_profile("tinker_sr_fuzz")


def scaled(n: int) -> int:
    """A test's own example count ``n`` (set below 200 for slow tests), scaled as
    ``TINKER_SR_FUZZ_EXAMPLES`` scales 200 (120 by default: ``n`` x 0.6)."""
    return max(1, n * FUZZ.max_examples // BASE_EXAMPLES)
