"""What `serve` checks before it loads anything heavy: the address, the API keys, the
settings it reads from the environment and that no other server holds the store. A refused
start is one line as soon as the interpreter is up, not after torch and the server are imported
(3.5-6 s on a busy or slow host)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from tinker_sr.engine.cpu import default_torch_threads
from tinker_sr.engine.env_settings import (
    checkpointing_setting,
    env_model_dtype_name,
    samplers_per_session,
)
from tinker_sr.engine.store import default_store_dir
from tinker_sr.model_aliases import env_aliases

from .connections import request_start_s
from .store_lock import StoreLock

__all__ = [
    "UnusableAddressError",
    "UnusableApiKeyError",
    "UnusableSettingError",
    "api_keys_from_env",
    "check_settings",
    "check_address",
    "loopback_only",
    "open_server_warning",
    "preflight",
]


class UnusableApiKeyError(ValueError):
    """A configured API key no Tinker client can send: the official SDK and tinker_sr refuse
    keys without the ``tml-`` prefix before connecting."""


class UnusableAddressError(ValueError):
    """``host:port`` cannot be listened on: a port out of range, a host that is not an address
    of this machine, or a port another program holds."""


class UnusableSettingError(ValueError):
    """An environment variable the engine or the server reads holds a value it cannot use."""


def check_settings() -> None:
    """Raise `UnusableSettingError` (naming the variable) where ``$TINKER_SR_MODEL_ALIASES``,
    ``$TINKER_SR_MODEL_DTYPE``, ``$TINKER_SR_TORCH_THREADS``, ``$TINKER_SR_REQUEST_START_S``,
    ``$TINKER_SR_ACTIVATION_CHECKPOINTING`` or ``$TINKER_SR_SAMPLERS_PER_SESSION`` cannot be
    used; torch-free, so it is said at once."""
    try:
        env_aliases()
        env_model_dtype_name()
        default_torch_threads()
        request_start_s()
        checkpointing_setting()
        samplers_per_session()
    except ValueError as e:
        raise UnusableSettingError(str(e)) from None


def loopback_only(host: str) -> bool:
    """Does ``host`` name only this machine's loopback addresses (127.0.0.0/8, ::1)?"""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def open_server_warning(host: str, keys: Sequence[str] | None) -> str | None:
    """What `serve` prints where it would take any key from beyond this machine."""
    if keys or loopback_only(host):
        return None
    return (
        f"WARNING: --host {host} listens beyond this machine and no --api-keys are set, so "
        "anyone who can reach it may use it (train and sample on this machine) with a key of "
        "their own; give --api-keys KEY1,KEY2 (or keep the default --host 127.0.0.1)"
    )


def check_address(host: str, port: int) -> None:
    """Raise `UnusableAddressError` naming the flag and the fix where the server could not
    listen on ``host:port`` (before the store is opened and the model loaded; uvicorn would
    say it only after, as a traceback or a log line)."""
    if not 0 <= port <= 65535:
        raise UnusableAddressError(f"--port {port}: a TCP port is a number from 0 to 65535")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UnusableAddressError(
            f"--host {host!r} is not an address of this machine ({e}); the default is 127.0.0.1"
        ) from None
    bound, held, foreign = False, None, None
    for family, kind, proto, _, address in addresses:  # the server binds each; one may fail
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's
            try:
                probe.bind(address)
                bound = True
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:  # held: the server would fail on it
                    held = e
                    break
                foreign = foreign or e  # not this machine's: another address may serve
    problem = held or (None if bound else foreign)
    if problem is not None:
        raise UnusableAddressError(
            f"cannot listen on {host}:{port} ({problem.strerror}): another program (another "
            "tinker-sr serve?) holds that port, or the address is not this machine's; pick "
            "another with --port (or --host)"
        ) from None


def api_keys_from_env() -> list[str] | None:
    """``TINKER_SR_API_KEYS`` (comma-separated), or None when unset/empty."""
    keys = [k.strip() for k in os.environ.get("TINKER_SR_API_KEYS", "").split(",") if k.strip()]
    return keys or None


def usable_keys(api_keys: Sequence[str] | str | None) -> list[str] | None:
    """The keys to accept (None: any ``tml-`` key): ``api_keys`` (a list, or comma-separated),
    else ``$TINKER_SR_API_KEYS``; a key no client can send stops the server here."""
    if isinstance(api_keys, str):
        api_keys = [k.strip() for k in api_keys.split(",") if k.strip()]
    keys = list(api_keys) if api_keys else api_keys_from_env()
    unusable = [k for k in keys or () if not k.startswith("tml-")]
    if unusable:  # else the server starts and no client can ever present the key
        raise UnusableApiKeyError(
            f"{len(unusable)} of the configured API keys (--api-key / --api-keys / "
            "$TINKER_SR_API_KEYS) do not start with 'tml-', and no Tinker client sends such a "
            "key (the official SDK refuses it before connecting): use keys like tml-<secret>"
        )
    return keys


def preflight(
    host: str,
    port: int,
    api_keys: Sequence[str] | str | None,
    store: str | os.PathLike[str] | None,
) -> tuple[list[str] | None, Path]:
    """The checks a server start can fail without its model: ``host:port`` free to listen on,
    keys a client can send, the environment's settings usable (`check_settings`), the store
    writable and held by no live server (`StoreInUseError`; the server takes the lock for good
    later).
    Returns the keys to accept (None: any ``tml-`` key) and the store directory."""
    check_address(host, port)
    keys = usable_keys(api_keys)
    check_settings()
    store_dir = Path(store).expanduser() if store is not None else default_store_dir()
    StoreLock(store_dir).release()
    return keys, store_dir
