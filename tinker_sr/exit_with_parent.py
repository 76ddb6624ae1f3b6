"""A server started by a test fixture stops when the process that started it is gone.

`tinker_sr.testing.server.ServerProcess` puts its pid in ``$TINKER_SR_EXIT_WITH_PARENT``;
`tinker-sr serve` and the testing server then watch it (`exit_with_parent`). Torch-free: the
fixtures import the variable's name without the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from tinker_sr.threads import start_thread

PARENT_ENV = "TINKER_SR_EXIT_WITH_PARENT"


def exit_with_parent(poll_s: float = 0.5) -> None:
    """Where ``$TINKER_SR_EXIT_WITH_PARENT`` names the starting process: stop (SIGTERM to
    itself, then exit after 15 s) once that process is gone. A test run killed by a CI
    timeout, ended with os._exit by pytest-timeout, or a crashed xdist worker runs no
    teardown, and its server used to live on, holding its port, store and memory."""
    raw = os.environ.pop(PARENT_ENV, "")  # not inherited by what this server starts
    # POSIX only: on Windows a parent's death changes no getppid(), and behind a venv
    # launcher the pid recorded is not the parent's.
    if not raw.isdigit() or os.name != "posix":
        return
    parent = int(raw)

    def watch() -> None:
        while os.getppid() == parent:  # reparented (to init or a subreaper): the parent died
            time.sleep(poll_s)
        logging.getLogger("tinker_sr.server").warning(
            "the process that started this server (pid %d) is gone: stopping", parent
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(15)
        os._exit(1)

    start_thread(
        threading.Thread(target=watch, name="exit-with-parent", daemon=True),
        "the thread that watches for the parent process's exit",
    )
