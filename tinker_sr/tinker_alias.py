"""Make ``import tinker`` (and every ``tinker.*`` submodule) resolve to tinker_sr.

`install_as_tinker` puts a meta-path finder first on ``sys.meta_path``. For ``tinker.<rest>``:

* a tinker_sr module that plays the same part (``tinker.types.datum`` ->
  ``tinker_sr.types.datum``, ``tinker.lib.public_interfaces.training_client`` ->
  ``tinker_sr.clients.training``) is returned as the *same module object*, never loaded a second
  time under the ``tinker`` name, so ``tinker.types.TensorData is tinker_sr.TensorData`` and
  ``isinstance`` checks hold across both spellings;
* any other module of the official SDK (`SDK_MODULES`: its HTTP internals, CLI, per-type
  modules such as ``tinker.types.sample_request``) becomes a small stand-in module whose
  attributes are looked up in tinker_sr (``tinker.types.sample_request.SampleRequest`` is
  ``tinker_sr.types.SampleRequest``); a name tinker_sr has no counterpart for raises an
  `AttributeError` that says so;
* a name the official SDK does not have is not found (`ModuleNotFoundError`).

The finder must also answer for names that a tinker_sr directory *would* hold: left to the
normal path finder, ``tinker.types.tensor_data`` would load ``tinker_sr/types/tensor_data.py``
again as a new module, with its own ``TensorData`` class.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types
from collections.abc import Sequence
from typing import Any

from tinker_sr._sdk_modules import SDK_MODULES

__all__ = [
    "SDK_MODULES",
    "install_as_tinker",
    "is_installed",
    "LaunchError",
    "resolve",
    "run_program",
]

# Official module -> the tinker_sr module that plays its part, where the paths differ.
_RENAMED: dict[str, str] = {
    "tinker._exceptions": "tinker_sr.errors",
    "tinker.lib.public_interfaces.api_future": "tinker_sr.futures",
    "tinker.lib.public_interfaces.admin_client": "tinker_sr.clients.admin",
    "tinker.lib.public_interfaces.custom_loss": "tinker_sr.clients.custom_loss",
    "tinker.lib.public_interfaces.rest_client": "tinker_sr.clients.rest",
    "tinker.lib.public_interfaces.sampling_client": "tinker_sr.clients.sampling",
    "tinker.lib.public_interfaces.service_client": "tinker_sr.clients.service",
    "tinker.lib.public_interfaces.training_client": "tinker_sr.clients.training",
}
# Official modules whose same-named tinker_sr module is something else (our ``tinker_sr.cli``
# is the tinker-sr command line, the SDK's ``tinker.cli`` is a package of click commands).
_NOT_SAME: frozenset[str] = frozenset({"tinker.cli"})
# Where a stand-in module looks a name up after its nearest real ancestor.
_FALLBACKS: tuple[str, ...] = (
    "tinker_sr",
    "tinker_sr.types",
    "tinker_sr.lib.public_interfaces",
    "tinker_sr.errors",
    "tinker_sr.futures",
    "tinker_sr.lib.retry_handler",
)


def _is_tinker_name(fullname: str) -> bool:
    return fullname == "tinker" or fullname.startswith("tinker.")


def _real_module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def resolve(fullname: str) -> str | None:
    """The tinker_sr module that ``fullname`` (a ``tinker...`` name) is, or ``None`` when it
    is a stand-in (or not a module of the official SDK at all)."""
    if fullname == "tinker":
        return "tinker_sr"
    if fullname in _RENAMED:
        return _RENAMED[fullname]
    if fullname in _NOT_SAME:
        return None
    parent, _, child = fullname.rpartition(".")
    parent_target = resolve(parent)
    if parent_target is None:
        return None
    candidate = f"{parent_target}.{child}"
    return candidate if _real_module_exists(candidate) else None


def _nearest_real_ancestor(fullname: str) -> str:
    name = fullname
    while "." in name:
        name = name.rpartition(".")[0]
        target = resolve(name)
        if target is not None:
            return target
    return "tinker_sr"


def _stand_in(fullname: str) -> types.ModuleType:
    """A module named ``fullname`` whose attributes come from tinker_sr (looked up lazily, so
    creating it imports nothing)."""
    module = types.ModuleType(fullname, f"tinker_sr stand-in for the official SDK's {fullname}")
    sources = (_nearest_real_ancestor(fullname), *_FALLBACKS)

    def __getattr__(name: str) -> Any:
        if not name.startswith("__"):
            for source in sources:
                found = getattr(importlib.import_module(source), name, _MISSING)
                if found is not _MISSING:
                    return found
        raise AttributeError(
            f"module {fullname!r} (tinker_sr's stand-in for a module of the official SDK) has "
            f"no attribute {name!r}: tinker_sr has no counterpart for it"
        )

    module.__dict__["__getattr__"] = __getattr__  # PEP 562: consulted for missing names
    if _is_package(fullname):
        module.__path__ = []  # its submodules come from the finder, never from a directory
    return module


def _is_package(fullname: str) -> bool:
    return any(m.startswith(fullname + ".") for m in SDK_MODULES)


_MISSING = object()


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str | None) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if self.target is None:
            return _stand_in(spec.name)
        return None  # a throwaway module; exec_module swaps in the real one

    def exec_module(self, module: types.ModuleType) -> None:
        if self.target is None:
            return
        # The import system re-reads sys.modules after exec_module, so the name ends up bound
        # to the tinker_sr module itself (whose own __name__ and __spec__ stay untouched).
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _TinkerFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not _is_tinker_name(fullname):
            return None
        resolved = resolve(fullname)
        if resolved is None and fullname not in SDK_MODULES:
            # Not ours and not the SDK's; refuse here, or the path finder would look in the
            # parent's tinker_sr directory and load a second copy of a tinker_sr module.
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (tinker is tinker_sr here; the official SDK 0.38 "
                "has no such module either)",
                name=fullname,
            )
        is_package = resolved is None and _is_package(fullname)
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(resolved), is_package=is_package
        )


def is_installed() -> bool:
    """Whether ``import tinker`` gives tinker_sr in this process."""
    return any(isinstance(f, _TinkerFinder) for f in sys.meta_path)


def install_as_tinker() -> None:
    """Resolve ``tinker`` and every ``tinker.*`` module of the official SDK 0.38 to tinker_sr
    in this process, so unchanged ``import tinker`` code runs on tinker_sr. Idempotent.

    Call it before anything imports ``tinker``: if the official SDK is already loaded,
    objects of both would mix, so this raises `RuntimeError` instead.
    """
    if is_installed():
        return
    loaded = sorted(n for n in sys.modules if _is_tinker_name(n))
    if loaded:
        where = getattr(sys.modules.get("tinker"), "__file__", None) or "?"
        raise RuntimeError(
            f"install_as_tinker() must run before anything imports tinker; already loaded: "
            f"{', '.join(loaded[:5])}{' ...' if len(loaded) > 5 else ''} (from {where}). Call "
            "it first thing, or start the program with `tinker-sr run`."
        )
    for name in _NOT_SAME:
        # Registered up front: imported through the finder, the import system would bind it
        # as an attribute of its parent (tinker_sr), hiding tinker_sr's own module of that name.
        sys.modules[name] = _stand_in(name)
    sys.meta_path.insert(0, _TinkerFinder())


def _alias_started_interpreters() -> None:
    """Make interpreters the program starts (subprocesses, multiprocessing spawn workers) alias
    tinker too: through ``_as_tinker/sitecustomize.py``, first on their ``PYTHONPATH``.

    Only the hook goes there. The folder holding tinker_sr (site-packages, when installed)
    went too, ahead of every started interpreter's own standard library and packages: a child
    of another virtualenv ran on this one's packages, and one of another Python version got
    import errors. The hook adds that folder last, for this Python version only, and only
    where the child cannot import tinker_sr itself."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hook = os.path.join(package_parent, "tinker_sr", "_as_tinker")
    rest = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [hook, rest]))
    os.environ["TINKER_SR_AS_TINKER"] = "1"
    os.environ["TINKER_SR_AS_TINKER_PATH"] = package_parent
    os.environ["TINKER_SR_AS_TINKER_PY"] = "{}.{}".format(*sys.version_info[:2])


class LaunchError(Exception):
    """The program to run was not found (raised before any of it runs)."""


def run_program(target: str, argv: Sequence[str], *, module: bool) -> None:
    """Run a script (``python script.py argv...``) or a module (``python -m target argv...``)
    as ``__main__`` with tinker resolved to tinker_sr. Its `SystemExit` propagates."""
    install_as_tinker()
    _alias_started_interpreters()
    sys.argv = [target, *argv]  # run_module replaces argv[0] with the module's path, as -m does
    if module:
        sys.path.insert(0, os.getcwd())
        if not _real_module_exists(target):
            raise LaunchError(f"tinker-sr run: no module named {target!r}")
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if os.path.isdir(target):  # as `python DIR`: its __main__.py, with DIR first on the path
        if not os.path.isfile(os.path.join(target, "__main__.py")):
            raise LaunchError(f"tinker-sr run: can't find '__main__' module in {target!r}")
        sys.path.insert(0, os.path.abspath(target))
    elif os.path.isfile(target):
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    else:
        raise LaunchError(f"tinker-sr run: can't open file {target!r}: no such file")
    runpy.run_path(target, run_name="__main__")
