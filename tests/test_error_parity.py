"""The same misuse raises the same exception class on every backend: the embedded engine, our
client against `tinker-sr serve`, and the official SDK against it (the oracle: what a Tinker
script catches); and the same calls return results of the same shape (fields, their types, the
literal tags). A request a server refuses before accepting it is an HTTP error
(`NotFoundError` for an unknown id, `BadRequestError` for a malformed one); one it accepts and
then fails is `RequestFailedError`."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests._server import ServerProcess
from tests._train import rl_datum_with_provenance, service_where_a_gap_hangs

tinker = pytest.importorskip("tinker")

MODEL = "tinker-sr/tiny"
MISSING = "tinker://no-such-run/weights/x"

Case = Callable[[SimpleNamespace], Any]
CASES: dict[str, tuple[str, Case]] = {
    "get_training_run(unknown)": ("NotFoundError", lambda c: c.rest.get_training_run("nope")),
    "list_checkpoints(unknown)": ("NotFoundError", lambda c: c.rest.list_checkpoints("nope")),
    "get_weights_info(unknown)": (
        "NotFoundError",
        lambda c: c.rest.get_weights_info_by_tinker_path(MISSING),
    ),
    "delete_checkpoint(unknown)": (
        "NotFoundError",
        lambda c: c.rest.delete_checkpoint_from_tinker_path(MISSING),
    ),
    "get_sampler(unknown)": ("NotFoundError", lambda c: c.rest.get_sampler("nope")),
    "sampling client on a missing checkpoint": (
        "NotFoundError",
        lambda c: c.service.create_sampling_client(
            model_path=MISSING.replace("weights", "sampler_weights")
        ),
    ),
    "sampling client on an unknown base model": (
        "BadRequestError",
        lambda c: c.service.create_sampling_client(base_model="no/such-model"),
    ),
    "num_samples=0": (
        "BadRequestError",
        lambda c: c.sampler.sample(c.types.ModelInput.from_ints([1, 2]), 0, c.params),
    ),
    "load_state(not a path)": ("BadRequestError", lambda c: c.training.load_state("not-a-path")),
    "load_state(unknown run)": ("NotFoundError", lambda c: c.training.load_state(MISSING)),
    "from_state(not a path)": (
        "BadRequestError",
        lambda c: c.service.create_training_client_from_state("not-a-path"),
    ),
    "from_state(missing in a known run)": (
        "RequestFailedError",
        lambda c: c.service.create_training_client_from_state(f"tinker://{c.run}/weights/nope"),
    ),
    "training client on an unknown base model": (
        "RequestFailedError",
        lambda c: c.service.create_lora_training_client("no/such-model", rank=4),
    ),
    # Found by the session-32 differential fuzzer: the embedded engine raised
    # RequestFailedError for the first three and the sampler path, ValueError for the last.
    "optim_step(learning_rate=nan)": (
        "BadRequestError",
        lambda c: c.training.optim_step(c.types.AdamParams(learning_rate=float("nan"))),
    ),
    "forward_backward(loss_fn='')": (
        "BadRequestError",
        lambda c: c.training.forward_backward([_datum(c.types)], ""),
    ),
    "save_state('')": ("BadRequestError", lambda c: c.training.save_state("")),
    "sample(temperature=nan)": (
        "ValueError",
        lambda c: c.sampler.sample(
            c.types.ModelInput.from_ints([1, 2]), 1, c.types.SamplingParams(temperature=math.nan)
        ),
    ),
    "sample beyond the context (3 + 600 > 512)": (
        "BadRequestError",  # as the hosted service: refused, not a failed future
        lambda c: c.sampler.sample(
            c.types.ModelInput.from_ints([1, 2, 3]), 1, c.types.SamplingParams(max_tokens=600)
        ),
    ),
    "get_weights_info(not a path)": (
        "BadRequestError",
        lambda c: c.rest.get_weights_info_by_tinker_path("not-a-path"),
    ),
    "copy_weights(not a path)": (
        "BadRequestError",
        lambda c: c.rest.copy_weights("not-a-path", destination_project_id="p"),
    ),
    "get_training_run(access_scope='bogus')": (
        "BadRequestError",
        lambda c: c.rest.get_training_run(c.run, access_scope="bogus"),
    ),
    "list_training_runs(project_id=...)": (
        "BadRequestError",
        lambda c: c.rest.list_training_runs(project_id="p"),
    ),
    "publish an external weights export": (
        "BadRequestError",
        lambda c: c.rest.publish_checkpoint_from_tinker_path(
            c.training.save_weights_external("x").result().path
        ),
    ),
    "delete_checkpoint(run, not kind/name)": (
        "NotFoundError",  # no such route on a server
        lambda c: c.rest.delete_checkpoint(c.run, "a"),
    ),
    # The official SDK builds its LoadWeightsRequest in the future: a path that is not a string
    # fails it with pydantic's error naming `path` (ours: an AttributeError on .startswith).
    "from_state(a list as the path)": (
        "ValidationError",
        lambda c: c.service.create_training_client_from_state(["tinker://a/weights/b"]),
    ),
    "from_state_with_optimizer(an int as the path)": (
        "ValidationError",
        lambda c: c.service.create_training_client_from_state_with_optimizer(3),
    ),
    "sampling client on model_path=''": (
        "BadRequestError",
        lambda c: c.service.create_sampling_client(model_path=""),
    ),
    "forward(token id 2**31)": (
        "OverflowError",
        lambda c: c.training.forward([_datum(c.types, 2**31)], "cross_entropy"),
    ),
    "from_state(a sampler checkpoint)": (
        "RequestFailedError",
        lambda c: c.service.create_training_client_from_state(
            c.training.save_weights_for_sampler("s").result().path
        ),
    ),
    # Hosted-service endpoints: missing from our RestClient before (AttributeError).
    "search_sessions": (
        "BadRequestError",
        lambda c: c.rest.search_sessions(c.types.SessionSearchRequest()),
    ),
    "assign_session_project": (
        "BadRequestError",
        lambda c: c.rest.assign_session_project(c.run.split(":")[0], "p"),
    ),
    "export_session_trace": (
        "BadRequestError",
        lambda c: c.rest.export_session_trace(c.run.split(":")[0]),
    ),
    "whoami": ("RuntimeError", lambda c: c.rest.whoami()),
    # Found by the session-35 users.md audit: our remote client raised pydantic's
    # ValidationError (it sent Dimuon as adam_params), the embedded engine RequestFailedError;
    # kind="inflight" raised a plain ValueError on both.
    "optim_step(DimuonParams)": (
        "BadRequestError",
        lambda c: c.training.optim_step(c.types.DimuonParams(learning_rate=1e-3)),
    ),
    "save_weights_and_get_sampling_client(kind='inflight')": (
        "BadRequestError",
        lambda c: c.training.save_weights_and_get_sampling_client(kind="inflight"),
    ),
    "from_state(weights_access_token=...)": (
        "BadRequestError",
        lambda c: c.service.create_training_client_from_state(
            c.training.save_state("tok").result().path, weights_access_token="t"
        ),
    ),
}


def _datum(types: Any, token: int = 1) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints([token, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )


def _raised(fn: Case, clients: SimpleNamespace) -> str:
    try:
        out = fn(clients)
        if hasattr(out, "result"):
            out.result()
    except Exception as e:  # the class is what is compared
        return type(e).__name__
    return "nothing"


def _clients(lib: Any, service: Any) -> SimpleNamespace:
    training = service.create_lora_training_client(MODEL, rank=4)
    training = training.result() if hasattr(training, "result") else training
    return SimpleNamespace(
        service=service,
        rest=service.create_rest_client(),
        training=training,
        run=training.model_id,
        sampler=training.save_weights_and_get_sampling_client(),
        types=lib.types,
        params=lib.types.SamplingParams(max_tokens=2),
    )


@pytest.fixture(scope="module")
def server(remote_server: ServerProcess) -> ServerProcess:
    """The suite's server (tests/conftest.py), the remote backend's too: no second start-up."""
    return remote_server


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # load_state deprecated, search experimental
def test_misuse_raises_the_sdks_class_on_every_backend(service: Any, server: ServerProcess) -> None:
    import tinker_sr

    ours = _clients(tinker_sr, service)
    sdk_service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    try:
        theirs = _clients(tinker, sdk_service)
        got = {name: (_raised(fn, ours), _raised(fn, theirs)) for name, (_, fn) in CASES.items()}
    finally:
        sdk_service.close("success").result()
    expected = {name: (cls, cls) for name, (cls, _) in CASES.items()}
    assert got == expected


@pytest.mark.parametrize("way", ["embedded", "remote"])
def test_a_refused_training_request_leaves_no_gap(way: str, tmp_path: Any) -> None:
    """A numbered request refused before it is accepted frees its number on both paths. Before:
    our remote client refused a NaN AdamParams itself (the SDK sends it as null and the server
    refuses it) and failed to encode a token id over int32 after numbering it, each leaving a
    gap that held the model's next request for the server's grace period (600 s here, so a
    gap would hang)."""
    import tinker_sr

    with service_where_a_gap_hangs(way, tmp_path / "store") as service:
        tc = service.create_lora_training_client(MODEL, rank=2).result()
        nan = tinker_sr.types.AdamParams(learning_rate=math.nan)
        for error, bad in (
            (tinker_sr.BadRequestError, lambda: tc.optim_step(nan)),
            (tinker_sr.BadRequestError, lambda: tc.forward_backward([_datum(tinker_sr.types)], "")),
            (tinker_sr.BadRequestError, lambda: tc.save_state("")),
            (OverflowError, lambda: tc.forward([_datum(tinker_sr.types, 2**31)], "cross_entropy")),
        ):
            with pytest.raises(error):
                bad().result(timeout=60)
            tc.forward_backward([_datum(tinker_sr.types)], "cross_entropy").result(timeout=60)
        service.close().result()


def test_a_sample_beyond_the_context_is_the_refusal_tinker_cookbook_recognises(
    service: Any, server: ServerProcess
) -> None:
    """tinker-cookbook's capture proxy tells an agent to compact its history when the service
    refuses a sample with the hosted service's overflow words (a BadRequestError). Before: a
    RequestFailedError in other words, which the proxy answered with a 500."""
    import tinker_sr

    recognises = pytest.importorskip("tinker_cookbook.capture.proxy.app")._is_context_overflow
    sdk_service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    for lib, svc in ((tinker_sr, service), (tinker, sdk_service)):
        sampler = svc.create_sampling_client(base_model=MODEL)
        sampler = sampler.result() if hasattr(sampler, "result") else sampler
        prompt = lib.types.ModelInput.from_ints([1] * 500)
        with pytest.raises(lib.BadRequestError) as refused:
            sampler.sample(prompt, 1, lib.types.SamplingParams(max_tokens=50)).result()
        assert recognises(str(refused.value)), str(refused.value)
        assert "500 prompt tokens + 50 max_tokens > 512" in str(refused.value)
        assert sampler.sample(prompt, 1, lib.types.SamplingParams(max_tokens=12)).result()
    sdk_service.close("success").result()


def test_embedded_checkpoint_listing_has_a_cursor(embedded_service: Any) -> None:
    """Before: `list_user_checkpoints().cursor` was None on the embedded engine."""
    clients = _clients(__import__("tinker_sr"), embedded_service)
    clients.training.save_state("a").result()
    clients.training.save_state("b").result()
    listing = clients.rest.list_user_checkpoints(limit=1).result()
    assert listing.cursor is not None and listing.cursor.total_count == 2
    assert (listing.cursor.offset, listing.cursor.limit, len(listing.checkpoints)) == (0, 1, 1)
    assert listing.checkpoints[0].checkpoint_id == "weights/b"  # newest first, as documented


def test_listings_are_newest_first_as_the_sdk_and_its_cli_read_them(server: ServerProcess) -> None:
    """Found by a hunt: the server listed runs and checkpoints oldest first, so the official
    `tinker run list` / `tinker checkpoint list` (the first 20 / 1000) hid the newest ones;
    the SDK documents `list_user_checkpoints` as "sorted by time (newest first)"."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    rest = service.create_rest_client()
    made = []
    for name in ("older", "newer"):
        training = service.create_lora_training_client(MODEL, rank=4)
        made.append((training.model_id, training.save_state(name).result().path))
    runs = rest.list_training_runs(limit=2).result().training_runs
    assert [r.training_run_id for r in runs] == [made[1][0], made[0][0]]
    checkpoints = rest.list_user_checkpoints(limit=2).result().checkpoints
    assert [c.tinker_path for c in checkpoints] == [made[1][1], made[0][1]]
    service.close("success").result()


def test_a_keys_listings_page_through_its_own_runs_only(server: ServerProcess) -> None:
    """The server pages each key's runs and checkpoints in the store's query (it used to build
    every owner's and filter them); the pages and counts are the caller's alone."""
    other = tinker.ServiceClient(base_url=server.base_url, api_key="tml-someone-else")
    other.create_lora_training_client(MODEL, rank=4).save_state("theirs").result()
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-pages")
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-pages")
    made = []
    for name in ("first", "second", "third"):
        training = service.create_lora_training_client(MODEL, rank=4)
        made.append((training.model_id, training.save_state(name).result().path))
    runs = rest.list_training_runs(limit=1, offset=1).result()
    assert runs.cursor.total_count == 3
    assert [r.training_run_id for r in runs.training_runs] == [made[1][0]]
    page = rest.list_user_checkpoints(limit=2, offset=2).result()
    assert page.cursor is not None and page.cursor.total_count == 3
    assert [c.tinker_path for c in page.checkpoints] == [made[0][1]]
    theirs = tinker.RestClient(base_url=server.base_url, api_key="tml-someone-else")
    theirs = theirs.list_user_checkpoints().result()
    assert [c.checkpoint_id for c in theirs.checkpoints] == ["weights/theirs"]
    service.close("success").result()
    other.close("success").result()


# Result fields whose values are fixed tags, compared as values; every other leaf by its type.
TAGS = {"type", "stop_reason", "checkpoint_type", "loss_fn_output_type", "dtype", "arch"}


def _shape(value: Any, key: str = "") -> Any:
    if hasattr(value, "model_dump"):
        return (type(value).__name__, _shape(value.model_dump()))
    if isinstance(value, dict):
        return {k: _shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_shape(value[0])] if value else []
    if key in TAGS or value is None:
        return value
    return type(value).__name__


def _results(lib: Any, service: Any) -> dict[str, Any]:
    """One short run through the public API; each result reduced to its shape."""
    c = _clients(lib, service)
    types, train, rest = lib.types, c.training, c.rest
    ids = [5, 6, 7]
    d = types.Datum(
        model_input=types.ModelInput.from_ints(ids),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
    prompt = types.ModelInput.from_ints(ids)
    recording = train.save_weights_and_get_sampling_client(record_stability_info=True)
    params = types.SamplingParams(max_tokens=3, seed=3, stop=[])
    sampled = recording.result().sample(prompt, 2, params, True, 2, 2).result()
    rl = rl_datum_with_provenance(types, ids, sampled.sequences[0])
    got = {
        "info": train.get_info(),
        "forward_backward": train.forward_backward([d], "cross_entropy").result(),
        "forward": train.forward([d], "cross_entropy").result(),
        "stable_reinforce": train.forward_backward([rl], "stable_reinforce").result(),
        "optim_step": train.optim_step(types.AdamParams(learning_rate=1e-3)).result(),
        "save_state": train.save_state("s").result(),
        "save_weights_for_sampler": train.save_weights_for_sampler("w").result(),
        "sample": c.sampler.sample(prompt, 2, types.SamplingParams(max_tokens=2)).result(),
        "sample(stability, top-k)": sampled,
        "compute_logprobs": c.sampler.compute_logprobs(prompt).result(),
        "capabilities": rest.get_server_capabilities().result(),
        "training_run": rest.get_training_run(c.run).result(),
        "training_runs": rest.list_training_runs().result().cursor,  # items: other tests' runs
        "checkpoints": rest.list_checkpoints(c.run).result(),
        "user_checkpoints": sorted(
            (
                x
                for x in rest.list_user_checkpoints().result().checkpoints
                if c.run in x.tinker_path
            ),
            key=lambda x: x.checkpoint_id,
        ),
        "weights_info": rest.get_weights_info_by_tinker_path(
            f"tinker://{c.run}/weights/s"
        ).result(),
    }
    shapes = {name: _shape(r) for name, r in got.items()}
    shapes["info"][1]["model_data"].pop("tokenizer_id")  # a server names a directory for the SDK
    return shapes


def test_results_have_the_sdks_shape_on_every_backend(service: Any, server: ServerProcess) -> None:
    """Before: our `save_weights_for_sampler` result carried ``type`` where the SDK's is None."""
    import tinker_sr

    sdk_service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    theirs = _results(tinker, sdk_service)
    ours = _results(tinker_sr, service)
    assert ours == theirs
    sdk_service.close("success").result()


# Calls the official SDK makes on its own clients for itself (telemetry, queue callbacks).
SDK_INTERNAL = ("get_telemetry", "on_queue_state_change")


def _public_calls(lib: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Wrap every public method of the four client classes of ``lib`` (as tinker-cookbook's
    capture and trace do) and return the log they append to: ``Class.method`` per call."""
    calls: list[str] = []

    def wrapped(cls: type, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name not in SDK_INTERNAL:
                calls.append(f"{cls.__name__}.{name}")
            return fn(*args, **kwargs)

        return call

    for cls in (lib.ServiceClient, lib.TrainingClient, lib.SamplingClient, lib.RestClient):
        for name, fn in list(vars(cls).items()):
            if not name.startswith("_") and inspect.isfunction(fn):
                monkeypatch.setattr(cls, name, wrapped(cls, name, fn))
    return calls


def _api_tour(lib: Any, service: Any) -> None:
    types = lib.types
    training = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
    training.forward([datum], "cross_entropy").result()
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=2, seed=0)
    sampler.sample(types.ModelInput.from_ints([5, 6]), 1, params).result()
    sampler.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()
    training.save_state("tour").result()
    service.create_sampling_client(base_model=MODEL)
    training.get_info()
    service.create_rest_client().list_checkpoints(training.model_id).result()


@pytest.mark.filterwarnings("ignore:create_rest_client:FutureWarning")
def test_wrappers_on_public_methods_see_the_sdks_calls(
    service: Any, server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tools wrap the clients' public methods (tinker-cookbook's capture records every
    `SamplingClient.sample`, its trace every call): the calls they see are the SDK's. Before:
    our `compute_logprobs` went through the public `sample`, so each one was recorded as a
    one-token sample (the SDK calls its private implementation)."""
    import tinker_sr

    theirs = _public_calls(tinker, monkeypatch)
    sdk_service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    try:
        _api_tour(tinker, sdk_service)
        theirs = list(theirs)  # the tour's calls (not the close below)
    finally:  # else its heartbeats warn for the rest of the run once this module's server stops
        sdk_service.close("success").result()
    ours = _public_calls(tinker_sr, monkeypatch)
    _api_tour(tinker_sr, service)
    assert "SamplingClient.compute_logprobs" in ours
    assert ours == theirs


# ---- RestClient look-ups given ill-typed and hostile ids and paths (the session-36 sweep) ----
# Before: the embedded engine handed a list or a dict id to SQLite ("internal error:
# ProgrammingError", a RequestFailedError) and a non-string tinker path to str methods
# (AttributeError, the same); a control character or a 64 KiB id, which httpx refuses in the
# SDK (InvalidURL), was a 404; an empty training run id (ValueError in the SDK) a 404;
# `copy_weights` of an ill-typed path failed its future (the SDK's pydantic ValidationError is
# raised at once); an unencodable ttl_seconds was a 400 (the SDK's TypeError / ValueError);
# publishing or copying an export in a run that does not exist was a 400 (a server: 404), and
# copying a missing export in one that does a 404 (a server: 400); the server answered
# GET /api/v1/sessions/<id holding "/"> 400 (the hosted-only endpoints' answer), not 404.
LONG = "x" * 5000
ILL_TYPED: dict[str, object] = {
    "list": ["a"],
    "dict": {"a": 1},
    "None": None,
    "int": 5,
    "bytes": b"abc",
    "nan": math.nan,
}
IDS: dict[str, object] = {
    **ILL_TYPED,
    "empty": "",
    "long": LONG,
    "longer than a URL": "x" * 70_000,
    "NUL": "a\x00b",
    "TAB": "a\tb",
    "../": "../x",
    "slash": "a/b",
    "a checkpoint path": "tinker://RUN/sampler_weights/x",
}
PATHS: dict[str, object] = {
    **ILL_TYPED,
    "empty": "",
    "not a path": "../x",
    "long": f"tinker://{LONG}/weights/x",
    "NUL in the run": "tinker://a\x00/weights/x",
    "NUL in the name": "tinker://RUN/weights/a\x00",
    "'..' as the run": "tinker://../weights/x",
    "'.' as the name": "tinker://RUN/weights/.",
    "no run": "tinker:///weights/x",
    "no run, an export": "tinker:///external_weights/x",
    "missing": "tinker://RUN/weights/nope",
    "missing sampler weights": "tinker://RUN/sampler_weights/nope",
    "missing export": "tinker://RUN/external_weights/nope",
    "an export of another run": "tinker://no-such-run/external_weights/x",
    "'?' in the name": "tinker://RUN/weights/a?b",
    "four parts": "tinker://RUN/weights/a/b",
}
TTLS: dict[str, object] = {**ILL_TYPED, "a string": "3600", "too short": 5, "set": {1}}
Sweep = Callable[[Any, str, Any], Any]
SWEEP: dict[str, tuple[dict[str, object], Sweep]] = {
    "get_training_run": (IDS, lambda r, run, v: r.get_training_run(v)),
    "get_training_run(access_scope='x')": (
        IDS,
        lambda r, run, v: r.get_training_run(v, access_scope="x"),
    ),
    "get_training_run_by_tinker_path": (
        PATHS,
        lambda r, run, v: r.get_training_run_by_tinker_path(v),
    ),
    "list_checkpoints": (IDS, lambda r, run, v: r.list_checkpoints(v)),
    "get_sampler": (IDS, lambda r, run, v: r.get_sampler(v)),
    "get_session": (IDS, lambda r, run, v: r.get_session(v)),
    "assign_session_project": (IDS, lambda r, run, v: r.assign_session_project(v, "p")),
    "export_session_trace": (IDS, lambda r, run, v: r.export_session_trace(v)),
    "delete_checkpoint(v, 'weights/s')": (
        IDS,
        lambda r, run, v: r.delete_checkpoint(v, "weights/s"),
    ),
    "delete_checkpoint(run, v)": (
        {**IDS, "'?' in the name": "weights/a?b"},
        lambda r, run, v: r.delete_checkpoint(run, v),
    ),
    "delete_checkpoint_from_tinker_path": (
        PATHS,
        lambda r, run, v: r.delete_checkpoint_from_tinker_path(v),
    ),
    "get_weights_info_by_tinker_path": (
        {**PATHS, "set": {1}},
        lambda r, run, v: r.get_weights_info_by_tinker_path(v),
    ),
    "set_checkpoint_ttl_from_tinker_path": (
        PATHS,
        lambda r, run, v: r.set_checkpoint_ttl_from_tinker_path(v, 3600),
    ),
    "set_checkpoint_ttl_from_tinker_path(ttl_seconds=v)": (
        TTLS,
        lambda r, run, v: r.set_checkpoint_ttl_from_tinker_path(f"tinker://{run}/weights/s", v),
    ),
    "publish_checkpoint_from_tinker_path": (
        PATHS,
        lambda r, run, v: r.publish_checkpoint_from_tinker_path(v),
    ),
    "unpublish_checkpoint_from_tinker_path": (
        PATHS,
        lambda r, run, v: r.unpublish_checkpoint_from_tinker_path(v),
    ),
    "get_external_weights_urls": (PATHS, lambda r, run, v: r.get_external_weights_urls(v)),
    "copy_weights": (PATHS, lambda r, run, v: r.copy_weights(v, "p")),
    "copy_weights(ttl_seconds=v)": (
        TTLS,
        lambda r, run, v: r.copy_weights(f"tinker://{run}/weights/s", "p", ttl_seconds=v),
    ),
}
# Not swept: an id holding "?" or "#" (the SDK writes ids into the URL unquoted, so
# list_checkpoints("a?b") reaches GET training_runs/a with a query string: 400; our clients
# quote it, or look the id up as given), and copy_weights without a project (which the SDK
# requires and tinker_sr does not: see RestClient.copy_weights).


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        out = fn()
    except Exception as e:
        return f"raises {type(e).__name__}"
    try:
        out.result(timeout=60)
    except Exception as e:
        return f"fails {type(e).__name__}"
    return "ok"


def _swept(service: Any) -> dict[str, str]:
    training = service.create_lora_training_client(MODEL, rank=2)
    training = training.result() if hasattr(training, "result") else training
    training.save_state("s").result()
    rest, run = service.create_rest_client(), training.model_id
    got = {}
    for method, (values, call) in SWEEP.items():
        for name, value in values.items():
            if isinstance(value, str) and value.startswith("tinker://RUN/"):
                value = value.replace("RUN", run, 1)
            got[f"{method} <- {name}"] = _outcome(lambda: call(rest, run, value))  # noqa: B023
    return got


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hostile_ids_and_paths_fail_as_in_the_sdk(service: Any, server: ServerProcess) -> None:
    """Every RestClient look-up, given each ill-typed or hostile id or path, raises at once
    or fails its future with the exception class the official SDK gets from `tinker-sr
    serve`; none is an internal error."""
    sdk_service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    try:
        theirs = _swept(sdk_service)
    finally:
        sdk_service.close("success").result()
    ours = _swept(service)
    assert not [k for k, v in ours.items() if v.endswith("RequestFailedError")]
    assert {k: v for k, v in ours.items() if v != theirs[k]} == {}
    # The sweep reaches each kind of answer.
    kinds = set(theirs.values())
    for kind in ("fails NotFoundError", "fails BadRequestError", "fails InvalidURL", "ok"):
        assert kind in kinds, kind
    for kind in ("fails ValueError", "fails TypeError", "raises ValidationError"):
        assert kind in kinds, kind


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_an_ill_typed_id_is_refused_naming_the_argument(embedded_service: Any) -> None:
    """The embedded engine's refusals say which argument is wrong and what it should be."""
    import tinker_sr

    rest = embedded_service.create_rest_client()
    with pytest.raises(tinker_sr.NotFoundError, match="training_run_id must be a str, got list"):
        rest.get_training_run(["a"]).result()
    with pytest.raises(tinker_sr.NotFoundError, match="sampler_id must be a str, got dict"):
        rest.get_sampler({"a": 1}).result()
    with pytest.raises(tinker_sr.BadRequestError, match="'tinker_path'.* valid string .*int"):
        rest.get_weights_info_by_tinker_path(5).result()
    with pytest.raises(httpx.InvalidURL, match="training_run_id='a\\\\x00b'"):
        rest.list_checkpoints("a\x00b").result()
    with pytest.raises(ValueError, match="non-empty value for `training_run_id`"):
        rest.list_checkpoints("").result()
    with pytest.raises(TypeError, match="ttl_seconds=.* cannot be sent as JSON"):
        rest.set_checkpoint_ttl_from_tinker_path("tinker://r/weights/s", {1}).result()


def test_deprecated_load_state_and_get_info_async_warn_as_the_sdk(
    embedded_service: Any, server: ServerProcess
) -> None:
    """Found by a hunt: `load_state`, `load_state_with_optimizer` and `get_info_async` only
    logged on the embedded engine, while the SDK also raises a FutureWarning (once per call),
    so `pytest.warns(FutureWarning)` or `-W error::FutureWarning` told the two apart."""
    import asyncio
    import warnings

    import tinker_sr

    sdk_service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    counts = []
    for lib, service in ((tinker_sr, embedded_service), (tinker, sdk_service)):
        training = service.create_lora_training_client(MODEL, rank=4).result()
        path = training.save_state("deprecations").result().path
        calls: dict[str, Callable[[], Any]] = {
            "load_state": lambda t=training, p=path: t.load_state(p).result(),
            "load_state_with_optimizer": lambda t=training, p=path: t.load_state_with_optimizer(p),
            "load_state_async": lambda t=training, p=path: asyncio.run(t.load_state_async(p)),
            "get_info_async": lambda t=training: asyncio.run(t.get_info_async()),
        }
        seen = {}
        for name, call in calls.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call()
            seen[name] = [w.category for w in caught if issubclass(w.category, FutureWarning)]
        counts.append((lib.__name__, seen))
    ours, theirs = counts[0][1], counts[1][1]
    assert ours == theirs == {name: [FutureWarning] for name in ours}, counts
    sdk_service.close("success").result()
