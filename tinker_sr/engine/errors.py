"""Old home of the engine's user errors: they moved to `tinker_sr.user_errors` (torch-free, shared
with the validator and the clients). Kept only so code written against the old path still imports;
import from `tinker_sr.user_errors`."""

from tinker_sr.user_errors import EngineNotFoundError, EngineUserError, check_same_names

__all__ = ["EngineNotFoundError", "EngineUserError", "check_same_names"]
