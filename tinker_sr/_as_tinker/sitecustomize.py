"""Started interpreters of a `tinker-sr run` program resolve ``tinker`` to tinker_sr too.

`tinker-sr run` puts this directory first on ``PYTHONPATH`` and sets ``TINKER_SR_AS_TINKER=1``;
Python imports ``sitecustomize`` at start-up, so subprocesses and ``multiprocessing`` spawn
workers of the program call `tinker_sr.install_as_tinker` before any of their code runs. A
``sitecustomize`` that this one shadows (further down ``sys.path``) still runs.
"""

import importlib.util
import os
import sys


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_run_shadowed_sitecustomize()
if os.environ.get("TINKER_SR_AS_TINKER") == "1":
    from tinker_sr.tinker_alias import install_as_tinker

    install_as_tinker()
