"""Started interpreters of a `tinker-sr run` program resolve ``tinker`` to tinker_sr too.

`tinker-sr run` puts this directory first on ``PYTHONPATH`` and sets ``TINKER_SR_AS_TINKER=1``;
Python imports ``sitecustomize`` at start-up, so subprocesses and ``multiprocessing`` spawn
workers of the program call `tinker_sr.install_as_tinker` before any of their code runs. A
``sitecustomize`` that this one shadows (further down ``sys.path``) still runs, once. Where
the interpreter cannot import tinker_sr itself, the program's copy is added at the end of
``sys.path`` if it is the same Python version (``$TINKER_SR_AS_TINKER_PATH``, ``_PY``).
"""

import importlib.util
import os
import sys


def _run_shadowed_sitecustomize() -> None:
    if getattr(sys, "_tinker_sr_hook_chained", False):  # a copy of this hook, found again
        return
    sys._tinker_sr_hook_chained = True  # type: ignore[attr-defined]
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    for entry in sys.path:
        folder = os.path.realpath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


def _find_tinker_sr() -> bool:
    if importlib.util.find_spec("tinker_sr") is not None:
        return True
    parent = os.environ.get("TINKER_SR_AS_TINKER_PATH")
    if not parent or os.environ.get("TINKER_SR_AS_TINKER_PY") != "{}.{}".format(
        *sys.version_info[:2]
    ):
        return False  # another Python could not load its compiled dependencies: no alias
    sys.path.append(parent)
    return importlib.util.find_spec("tinker_sr") is not None


_run_shadowed_sitecustomize()
if os.environ.get("TINKER_SR_AS_TINKER") == "1" and _find_tinker_sr():
    from tinker_sr.tinker_alias import install_as_tinker

    install_as_tinker()
