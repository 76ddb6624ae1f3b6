"""Old home of the size limits: they moved to `tinker_sr.limits` (torch-free, shared with the
validator). Kept only so code written against the old path still imports; import from
`tinker_sr.limits`."""

from tinker_sr.limits import DEFAULT_LIMITS, Limits

__all__ = ["DEFAULT_LIMITS", "Limits"]
