"""Started interpreters of a `tinker-sr run` program resolve ``tinker`` to tinker_sr too.

`tinker-sr run` puts this directory first on ``PYTHONPATH`` and sets ``TINKER_SR_AS_TINKER=1``;
Python imports ``sitecustomize`` at start-up, so subprocesses and ``multiprocessing`` spawn
workers of the program call `tinker_sr.install_as_tinker` before any of their code runs. The
first ``sitecustomize`` further down ``sys.path`` that is not a copy of this hook still runs.
Where the interpreter cannot import tinker_sr itself, the program's copy is tried at the end
of ``sys.path`` if it is the same Python version (``$TINKER_SR_AS_TINKER_PATH``, ``_PY``);
where that fails too (another virtualenv without its dependencies), the path is left as it
was and ``tinker`` is not aliased.
"""

import importlib.util
import os
import sys

_HOOK_MARK = "_tinker_sr_hook_chained"  # in this file's text: how copies of it are told


def _run_shadowed_sitecustomize() -> None:
    if getattr(sys, _HOOK_MARK, False):  # already chained in this interpreter
        return
    setattr(sys, _HOOK_MARK, True)
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    for entry in sys.path:
        folder = os.path.realpath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder == here or not os.path.isfile(candidate):
            continue
        try:
            with open(candidate, encoding="utf-8", errors="replace") as f:
                if _HOOK_MARK in f.read():  # another copy of this hook (another install)
                    continue
        except OSError:
            continue
        spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


def _alias() -> None:
    appended = None
    if importlib.util.find_spec("tinker_sr") is None:
        parent = os.environ.get("TINKER_SR_AS_TINKER_PATH")
        here_py = "{}.{}".format(*sys.version_info[:2])
        if not parent or os.environ.get("TINKER_SR_AS_TINKER_PY") != here_py:
            return  # another Python could not load its compiled dependencies: no alias
        sys.path.append(parent)
        appended = parent
    try:
        from tinker_sr.tinker_alias import install_as_tinker

        install_as_tinker()
    except ImportError:  # its dependencies are not this interpreter's: no alias
        if appended is None:
            raise
        sys.path.remove(appended)
        for name in [n for n in sys.modules if n == "tinker_sr" or n.startswith("tinker_sr.")]:
            del sys.modules[name]


_run_shadowed_sitecustomize()
if os.environ.get("TINKER_SR_AS_TINKER") == "1":
    _alias()
