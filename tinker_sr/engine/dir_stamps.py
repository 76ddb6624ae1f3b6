"""What a model directory's files were when its base model loaded: sizes and modification
times of its config, tokenizer and weight files. The engine loads a directory once and shares
it; a directory saved again in place (``save_pretrained`` rerun in a notebook, a served
``--model-dir`` updated) would otherwise go on serving the weights as first loaded to every
new client, as long as any client of it was open, without a word."""

from __future__ import annotations

from pathlib import Path

from tinker_sr.engine.hf import INDEX_FILE, weight_files
from tinker_sr.engine.model import BUILTIN_CONFIGS
from tinker_sr.user_errors import EngineUserError

__all__ = ["LoadedDirs", "Stamp", "dir_stamp"]

Stamp = tuple[tuple[str, int, int], ...]
_READ = ("config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE)


def dir_stamp(resolved: str) -> Stamp | None:
    """Each file the engine reads from directory ``resolved`` with its size and modification
    time in ns (-1 for one that is missing); None for a built-in model."""
    root = Path(resolved)
    if resolved in BUILTIN_CONFIGS or not root.is_dir():  # (not a folder its name may name)
        return None
    try:
        weights = [str(p.relative_to(root)) for p in weight_files(root)]
    except Exception:  # an index broken since: compared as what the folder holds
        weights = sorted(p.name for p in root.glob("*.safetensors"))
    out = []
    for name in (*_READ, *weights):
        try:
            st = (root / name).stat()
        except OSError:
            out.append((name, -1, -1))
        else:
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def changed_error(resolved: str, was: Stamp, now: Stamp | None) -> EngineUserError:
    """The refusal of a new client of ``resolved`` whose files changed while open clients
    still compute the model as it loaded."""
    changed = sorted({n for n, *_ in set(was) ^ set(now or ())})
    return EngineUserError(
        f"base_model {resolved}: the model directory changed on disk since it was loaded "
        f"({', '.join(changed)}), and open clients of it still compute the weights as they "
        "loaded; close them (a server: restart it) and a new client loads the new files, or "
        "save the new weights to a directory of their own"
    )


class LoadedDirs:
    """The stamps of the directories whose base models are loaded (`ModelRegistry`)."""

    def __init__(self) -> None:
        self._stamps: dict[str, Stamp | None] = {}

    def loading(self, resolved: str) -> None:
        """``resolved``'s base is about to be read: its files now."""
        self._stamps[resolved] = dir_stamp(resolved)

    def changed(self, resolved: str, now: Stamp | None, in_use: set[str]) -> bool:
        """Whether ``resolved``, whose files are ``now`` (`dir_stamp`), changed since it
        loaded, where no open client uses it (its base must be loaded again); raises
        `changed_error` where one does."""
        was = self._stamps.get(resolved)
        if was is None or now == was:
            return False
        if resolved in in_use:
            raise changed_error(resolved, was, now)
        return True

    def keep(self, loaded: set[str]) -> None:
        """Forget the stamps of directories whose bases were freed."""
        for resolved in [r for r in self._stamps if r not in loaded]:
            del self._stamps[resolved]
