"""``python -m tinker_sr.server``: same as ``tinker-sr serve``."""

from __future__ import annotations

import argparse

from .app import DEFAULT_LONG_POLL_S, DEFAULT_MAX_BODY_BYTES
from .run import serve


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tinker_sr.server",
        description="Serve the tinker_sr engine over the Tinker wire protocol.",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--store", default=None, help="state directory (default $TINKER_SR_STORE)")
    p.add_argument(
        "--api-keys",
        default=None,
        help="comma-separated accepted keys (default $TINKER_SR_API_KEYS; else any 'tml-' key)",
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--log-level", default="info")
    p.add_argument("--long-poll-s", type=float, default=DEFAULT_LONG_POLL_S, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    serve(
        host=args.host,
        port=args.port,
        store=args.store,
        api_keys=args.api_keys,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        long_poll_s=args.long_poll_s,
    )


if __name__ == "__main__":
    main()
