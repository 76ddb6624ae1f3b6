"""`tinker-sr` command line: serve, demo, plot, models, run, export, usage."""

from __future__ import annotations

import argparse
import io
import math
import os
import sqlite3
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from tinker_sr.limits import DEFAULT_LIMITS, Limits

if TYPE_CHECKING:
    from tinker_sr.engine.usage import RateCard

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def _cmd_serve(args: argparse.Namespace) -> int:
    from tinker_sr.engine.store import StoreDamagedError, StoreUnwritableError
    from tinker_sr.server.features import ServerFeatures
    from tinker_sr.server.preflight import (
        UnusableAddressError,
        UnusableApiKeyError,
        UnusableSettingError,
        preflight,
    )
    from tinker_sr.server.run import serve
    from tinker_sr.server.store_lock import StoreInUseError

    refusals = (  # another live server; a bad database; a read-only directory; a bad address
        StoreInUseError,
        StoreDamagedError,
        StoreUnwritableError,
        UnusableApiKeyError,
        UnusableAddressError,
        UnusableSettingError,
    )
    keys = [k for k in (args.api_key or []) if k]
    keys += [k.strip() for k in (args.api_keys or "").split(",") if k.strip()]
    if not keys and (args.api_key or args.api_keys is not None):
        # `--api-key "$UNSET"`: refusing beats a server open to every key
        raise SystemExit(
            "tinker-sr serve: --api-key/--api-keys name no key (empty: an unset variable?); "
            "pass the keys clients must send, or leave the options out to accept any 'tml-' key"
        )
    model_aliases_from_args(args, deep=False)  # a missing --model-dir: said before torch too
    try:  # what can refuse the start, said before torch and the server load (seconds)
        checked = preflight(args.host, args.port, keys or None, args.store)
    except refusals as e:
        raise SystemExit(f"tinker-sr serve: {e}") from None
    try:
        serve(
            host=args.host,
            port=args.port,
            store=args.store,
            api_keys=keys or None,
            log_level=args.log_level,
            long_poll_s=args.long_poll_s,
            features=ServerFeatures(
                stable_reinforce=not args.without_stable_reinforce,
                record_stability_info=not args.ignore_stability_info,
                two_d_targets=not args.only_1d_targets,
                sample_topk=not args.ignore_topk_sample_logprobs,
            ),
            limits=limits_from_args(args),
            model_aliases=model_aliases_from_args(args),
            device=device_from_args(args),
            rate_card=rate_card_from_args(args),
            logprobs_mode=args.logprobs_mode,
            session_timeout_s=args.session_timeout_s,
            sample_abandon_s=args.sample_abandon_s,
            checked=checked,
        )
    except refusals as e:
        raise SystemExit(f"tinker-sr serve: {e}") from None
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from tinker_sr.engine.model import BUILTIN_CONFIGS, build_model, count_parameters

    for name, cfg in sorted(BUILTIN_CONFIGS.items()):
        n = count_parameters(build_model(name))
        print(
            f"{name:20s} {n / 1e6:8.2f}M params  ctx {cfg.max_seq_len:5d}  vocab {cfg.vocab_size}"
        )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from tinker_sr.demo import main as demo_main

    return demo_main(args)


def _cmd_export(args: argparse.Namespace) -> int:
    from tinker_sr.backend.local import default_store_dir
    from tinker_sr.engine.export import export_checkpoint
    from tinker_sr.engine.store import StoreDamagedError
    from tinker_sr.model_aliases import env_aliases
    from tinker_sr.user_errors import EngineUserError

    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out,
            merge=args.merge,
            store_dir=Path(args.store).expanduser() if args.store else default_store_dir(),
            base_model=args.base_model,
            aliases=env_aliases(),
        )
    # OSError: e.g. an unwritable or full destination (the error names the file); a store
    # that cannot be read as it stands (sqlite3.DatabaseError), also one-line
    except (EngineUserError, StoreDamagedError, OSError, sqlite3.DatabaseError) as e:
        print(f"tinker-sr export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from tinker_sr.tinker_alias import LaunchError, run_program

    rest, module = list(args.argv), args.module
    if module is None and not rest:
        print("tinker-sr run: give a script (or -m module) to run", file=sys.stderr)
        return 2
    target, argv = (module, rest) if module is not None else (rest[0], rest[1:])
    try:
        run_program(target, argv, module=module is not None)
    except LaunchError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    from tinker_sr.server.defaults import DEFAULT_LOGPROBS_MODE, DEFAULT_LONG_POLL_S, LOGPROBS_MODES

    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--store",
        default=None,
        help="state directory (default $TINKER_SR_STORE or ~/.cache/tinker_sr)",
    )
    s.add_argument(
        "--api-key",
        action="append",
        help="accept only this key (repeatable; also $TINKER_SR_API_KEYS). Default: any 'tml-' key",
    )
    s.add_argument("--api-keys", default=None, help="comma-separated form of --api-key")
    s.add_argument(
        "--model-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="serve this local Hugging Face model directory, as base_model DIR or its folder "
        "name, or a Hub name found in the local Hugging Face cache (e.g. Qwen/Qwen3-0.6B, "
        "served under that name; nothing is downloaded) (repeatable). Requests cannot name "
        "directories themselves",
    )
    s.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME=TARGET",
        help="serve base_model NAME as TARGET, a built-in model, a local directory or a Hub "
        "name in the local Hugging Face cache (repeatable; also $TINKER_SR_MODEL_ALIASES)",
    )
    s.add_argument(
        "--allow-no-tokenizer",
        action="store_true",
        help="serve model directories that hold no tokenizer files (token ids in and out "
        "only; the official SDK's get_tokenizer() would build an empty one). Default: refused "
        "at start",
    )
    for limit in fields(Limits):  # one flag per limit: tinker_sr/limits.py is the one place
        default = getattr(DEFAULT_LIMITS, limit.name)
        s.add_argument(
            "--" + limit.name.replace("_", "-"),
            type=int,
            default=default,
            help=f"{Limits.help(limit.name)} (default {default})",
        )
    s.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default=None,
        help="where the engine runs: cpu, cuda (an NVIDIA GPU; error if none), or auto (the GPU "
        "when there is one). Default $TINKER_SR_DEVICE, else cpu",
    )
    s.add_argument(
        "--rate-card",
        default=None,
        metavar="FILE",
        help="JSON prices (USD per million tokens per kind, per GB-month of storage) for the "
        "usage AdminClient.get_billing_usage / `tinker billing usage` report (default "
        "$TINKER_SR_RATE_CARD; none: counted, not priced). docs/server.md",
    )
    s.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default=DEFAULT_LOGPROBS_MODE,
        help="what the OpenAI-compatible routes' log-probs and top log-probs report, as vLLM's "
        "flag: raw_logprobs, the model's own at every temperature (default, as vLLM's); "
        "processed_logprobs, the distribution each token was drawn from (after temperature, "
        "top_k, top_p). The Tinker API's sampler always reports the latter",
    )
    _add_liveness_arguments(s)
    s.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    s.add_argument("--long-poll-s", type=float, default=DEFAULT_LONG_POLL_S, help=argparse.SUPPRESS)
    _add_featureless_arguments(s)


def _add_liveness_arguments(s: argparse.ArgumentParser) -> None:
    """How long a quiet session lives, and its sample requests run."""
    from tinker_sr.server.defaults import DEFAULT_SAMPLE_ABANDON_S, DEFAULT_SESSION_TIMEOUT_S

    s.add_argument(
        "--session-timeout-s",
        type=_seconds_or_never,
        default=DEFAULT_SESSION_TIMEOUT_S,
        metavar="S",
        help="finish a session with no heartbeat or request for S seconds as 'interrupted' "
        f"(default {DEFAULT_SESSION_TIMEOUT_S:g}; 0: never)",
    )
    s.add_argument(
        "--sample-abandon-s",
        type=_seconds_or_never,
        default=DEFAULT_SAMPLE_ABANDON_S,
        metavar="S",
        help="cancel the sample requests of a session with no heartbeat or request for S "
        f"seconds: its client has gone (default {DEFAULT_SAMPLE_ABANDON_S:g}; 0: never, for "
        "clients that send no heartbeats and collect their results later)",
    )


def _seconds_or_never(text: str) -> float | None:
    """A duration in seconds for a flag; 0 means never (None)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: never), got {text!r}")
    return value or None


def _add_featureless_arguments(s: argparse.ArgumentParser) -> None:
    f = s.add_argument_group(
        "feature-less mode",
        "play an engine without StableReinforce support (to test the client-side lowering)",
    )
    f.add_argument(
        "--without-stable-reinforce",
        action="store_true",
        help="refuse loss_fn='stable_reinforce' with HTTP 422",
    )
    f.add_argument(
        "--ignore-stability-info",
        action="store_true",
        help="ignore record_stability_info silently (record no draws)",
    )
    f.add_argument(
        "--only-1d-targets",
        action="store_true",
        help="refuse 2-D cross_entropy target_tokens with HTTP 422",
    )
    f.add_argument(
        "--ignore-topk-sample-logprobs",
        action="store_true",
        help="return no topk_sample_logprobs (ignored silently)",
    )


def device_from_args(args: argparse.Namespace) -> str | None:
    """``--device``, checked before the server starts: ``cuda`` without a GPU exits here with
    the reason and the fix."""
    from tinker_sr.engine.device import resolve_device

    try:
        resolve_device(args.device, what="--device")
    except ValueError as e:
        raise SystemExit(f"tinker-sr serve: {e}") from None
    return args.device


def rate_card_from_args(args: argparse.Namespace) -> RateCard | None:
    """``--rate-card`` (else ``$TINKER_SR_RATE_CARD``), read and checked before the server
    starts: a bad file exits here naming the entry and the fix."""
    from tinker_sr.engine.usage import RateCard

    try:
        return RateCard.resolve(args.rate_card)
    except ValueError as e:
        raise SystemExit(f"tinker-sr serve: {e}") from None


def limits_from_args(args: argparse.Namespace) -> Limits:
    try:
        return Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    except ValueError as e:
        raise SystemExit(f"tinker-sr serve: {e}") from None


def _check_model_config(
    option: str, flag: str, path: str, *, no_tokenizer_ok: bool, deep: bool
) -> None:
    """Refuse at start a directory the engine would refuse at first use: without a tokenizer
    vocabulary, or whose EOS ids and special tokens do not read (what each request builds
    first: config.json's vocab_size and eos_token_id, generation_config.json,
    tokenizer_config.json, tokenizer.json's added tokens); with ``deep`` (which loads torch),
    for its config.json, its weight files or their tensors' names, shapes and dtypes (headers
    only: no weight is read, so a damaged weight value is still found when the model loads)."""
    from tinker_sr.tokenization.hf import VOCABULARY_FILES, ModelTokenizer, has_vocabulary
    from tinker_sr.user_errors import EngineUserError

    try:
        if deep:
            from tinker_sr.engine.hf import check_model_dir

            check_model_dir(path, flag)
        vocabulary = has_vocabulary(path)
    except EngineUserError as e:
        raise SystemExit(f"tinker-sr serve: {option} {e}") from None
    if not no_tokenizer_ok and not vocabulary:
        # The SDK's get_tokenizer() would build an empty tokenizer (every text -> []) from it.
        raise SystemExit(
            f"tinker-sr serve: {option} {flag}: {path} holds no tokenizer vocabulary (none of "
            f"{', '.join(VOCABULARY_FILES)}), so clients could not encode or decode text; "
            "copy the model's tokenizer files there (transformers' tokenizer.save_pretrained() "
            "writes them), or pass --allow-no-tokenizer to serve it for token ids only"
        )
    try:
        ModelTokenizer(Path(path))
    except EngineUserError as e:
        raise SystemExit(f"tinker-sr serve: {option} {e}") from None


def _model_dir(option: str, value: str, label: str | None = None) -> tuple[str, bool]:
    """The directory a served name stands for, and whether it came from the HF cache: `value`
    itself when it holds config.json, else the snapshot of Hub name `value` in the local
    Hugging Face cache (nothing is downloaded)."""
    from tinker_sr.hf_files import cached_hub_model, not_found_hint

    path = os.path.abspath(os.path.expanduser(value))
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, False
    cached = cached_hub_model(value)
    if cached is None:
        raise SystemExit(
            f"tinker-sr serve: {option} {label or value}: no config.json in {path}; as a Hub name: "
            f"{not_found_hint(value)}"
        )
    return str(cached), True


def environment_problem() -> str | None:
    """Why a setting the embedded engine reads from the environment cannot be used (named),
    or None: checked before `demo` starts (and by `serve` itself), so it is one line, not a
    traceback, and said before torch loads."""
    from tinker_sr.server.preflight import UnusableSettingError, check_settings

    try:
        check_settings()
    except UnusableSettingError as e:
        return str(e)
    return None


def _alias_flags(values: list[str]) -> dict[str, str]:
    """``--model-alias`` values: each NAME=TARGET, or a comma list of them (as
    ``$TINKER_SR_MODEL_ALIASES``). A target path may hold commas: a value is a list only
    where every comma-separated part is NAME=TARGET."""
    from tinker_sr.model_aliases import alias_entry, parse_aliases

    out: dict[str, str] = {}
    for value in values:
        if all("=" in part for part in value.split(",") if part.strip()):
            out.update(parse_aliases(value, "--model-alias"))
        else:
            out.update([alias_entry(value, "--model-alias")])
    return out


def model_aliases_from_args(args: argparse.Namespace, *, deep: bool = True) -> dict[str, str]:
    """The names ``--model-dir``, ``--model-alias`` and ``$TINKER_SR_MODEL_ALIASES`` serve,
    each target checked (`SystemExit` naming the flag). ``deep=False`` checks what needs no
    torch (paths, names, tokenizer files), so ``serve`` says those before loading it."""
    from tinker_sr.model_aliases import ENV, env_aliases
    from tinker_sr.tokenization.byte import BYTE_TOKENIZER_MODELS as BUILT_IN

    aliases: dict[str, str] = {}
    no_tokenizer_ok = bool(getattr(args, "allow_no_tokenizer", False))
    for d in args.model_dir:
        path, from_cache = _model_dir("--model-dir", d)
        _check_model_config("--model-dir", d, path, no_tokenizer_ok=no_tokenizer_ok, deep=deep)
        # A directory is served under its path and folder name too; a cached Hub name under
        # that name only (its folder is a commit hash).
        names = (d,) if from_cache else (d, path, os.path.basename(path.rstrip(os.sep)))
        for name in names:
            if aliases.get(name, path) != path:  # e.g. two runs' ".../final" folders
                raise SystemExit(
                    f"tinker-sr serve: --model-dir {d}: the name {name!r} would serve both "
                    f"{aliases[name]} and {path}; serve one under a name of its own with "
                    f"--model-alias NAME={d}"
                )
            aliases[name] = path
    env = f"${ENV}"
    try:
        named = _alias_flags(args.model_alias)
        # The engine adds these itself; checked here so a bad one stops the start, as a flag's.
        from_env = env_aliases()
    except ValueError as e:
        raise SystemExit(f"tinker-sr serve: {e}") from None
    for option, entries in ((env, from_env), ("--model-alias", named)):
        for name, target in entries.items():
            if target not in BUILT_IN:  # a directory or a cached Hub name: check it now
                path, _ = _model_dir(option, target, label=f"{name}={target}")
                _check_model_config(
                    option, f"{name}={target}", path, no_tokenizer_ok=no_tokenizer_ok, deep=deep
                )
    aliases.update(named)
    return aliases


def build_parser() -> argparse.ArgumentParser:
    from tinker_sr import __version__

    p = argparse.ArgumentParser(prog="tinker-sr", description=__doc__)
    p.add_argument("--version", action="version", version=f"tinker-sr {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the embedded engine over the Tinker wire protocol")
    add_serve_arguments(s)
    s.set_defaults(func=_cmd_serve)

    m = sub.add_parser("models", help="list the built-in models")
    m.set_defaults(func=_cmd_models)

    from tinker_sr.demo import add_arguments

    d = sub.add_parser("demo", help="offline RL run on the embedded default model")
    add_arguments(d)
    d.set_defaults(func=_cmd_demo)

    from tinker_sr import plot

    pl = sub.add_parser(
        "plot",
        help="learning curves of your runs (a metrics.jsonl per run) as a PNG",
        description="Draw learning curves from metrics.jsonl files: what `tinker-sr demo` and "
        "tinker-cookbook's ml_log write. Several runs overlay on the same axes. Without "
        "matplotlib ('tinker-sr[plot]') it prints a text summary per key instead.",
    )
    plot.add_arguments(pl)
    pl.set_defaults(func=plot.main)

    r = sub.add_parser(
        "run",
        help="run a program that does `import tinker` on tinker_sr",
        usage="tinker-sr run (script.py | -m module) [args ...]",
        description="Run a script or module (like `python script.py` / `python -m module`) with "
        "`tinker` and every `tinker.*` module resolved to tinker_sr, unchanged.",
    )
    r.add_argument("-m", dest="module", metavar="module", help="run a module as a script")
    r.add_argument("argv", nargs=argparse.REMAINDER, help="the script (unless -m), then its args")
    r.set_defaults(func=_cmd_run)

    e = sub.add_parser(
        "export",
        help="export a LoRA checkpoint as a PEFT adapter, or (--merge) a merged HF model",
        description="Write a PEFT LoRA adapter directory (adapter_config.json + "
        "adapter_model.safetensors) or, with --merge, a merged Hugging Face model directory "
        "that transformers loads with tinker_sr's logits (docs/models.md).",
    )
    e.add_argument(
        "checkpoint",
        help="tinker://<run>/sampler_weights/<name> (or weights/<name>) or a checkpoint file",
    )
    e.add_argument("out", help="output directory: new or empty (created)")
    e.add_argument("--merge", action="store_true", help="write base + adapter as one HF model")
    e.add_argument(
        "--store",
        default=None,
        help="store of tinker:// paths (default $TINKER_SR_STORE, else ~/.cache/tinker_sr)",
    )
    e.add_argument(
        "--base-model",
        default=None,
        help="base model if not the checkpoint's (name, directory, HF-cache name or alias)",
    )
    e.set_defaults(func=_cmd_export)

    from tinker_sr import usage_report

    u = sub.add_parser(
        "usage",
        help="tokens trained, prefilled and sampled and checkpoints saved, from a store",
        description="Total what a store's sessions used (the numbers AdminClient."
        "get_billing_usage reports), per session, base model or UTC hour, and the checkpoint "
        "storage now. Reads the store only; a server may be running on it.",
    )
    usage_report.add_arguments(u)
    u.set_defaults(func=usage_report.main)
    return p


def _run_namespace(rest: list[str]) -> argparse.Namespace | None:
    """``run``'s arguments, parsed by hand: everything after the script (or ``-m module``)
    belongs to the program, dashes included, which argparse cannot express."""
    if rest and rest[0].startswith("-m"):
        module = rest[0][2:] or (rest[1] if len(rest) > 1 else "")
        if module:
            return argparse.Namespace(
                func=_cmd_run, module=module, argv=rest[1 if rest[0] != "-m" else 2 :]
            )
        return None
    if rest and not rest[0].startswith("-"):
        return argparse.Namespace(func=_cmd_run, module=None, argv=rest)
    return None  # -h, a bad option or nothing: argparse prints help or the usage error


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed = _run_namespace(argv[1:]) if argv[:1] == ["run"] else None
    # A terminal or pipe that is not UTF-8 (LC_ALL=C, PYTHONIOENCODING=ascii, a Windows
    # console) shows what it cannot encode escaped: `demo` printed its samples' U+FFFD and
    # `plot` its sparkline, and failed with UnicodeEncodeError after a finished run. (Not
    # for `run`: the program's output behaves as under `python prog.py`.)
    for stream in (sys.stdout, sys.stderr) if parsed is None else ():
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    args = parsed or build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `tinker-sr ... | head`: the reader left early, nothing failed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1
    except KeyboardInterrupt:
        if parsed is not None:  # `run`: the program's own Ctrl-C, as `python prog.py` shows it
            raise
        # Ctrl-C: `serve` has shut down gracefully by now, `demo` kept every finished step.
        print(f"tinker-sr {argv[0] if argv else ''}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
