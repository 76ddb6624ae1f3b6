"""The same misuse raises the same exception class on every backend: the embedded engine, our
client against `tinker-sr serve`, and the official SDK against it (the oracle: what a Tinker
script catches). A request a server refuses before accepting it is an HTTP error
(`NotFoundError` for an unknown id, `BadRequestError` for a malformed one); one it accepts and
then fails is `RequestFailedError`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests._server import ServerProcess, running_server

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
}


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
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("store")) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # load_state is deprecated in both
def test_misuse_raises_the_sdks_class_on_every_backend(service: Any, server: ServerProcess) -> None:
    import tinker_sr

    ours = _clients(tinker_sr, service)
    sdk_service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    theirs = _clients(tinker, sdk_service)
    got = {name: (_raised(fn, ours), _raised(fn, theirs)) for name, (_, fn) in CASES.items()}
    expected = {name: (cls, cls) for name, (cls, _) in CASES.items()}
    assert got == expected
    sdk_service.close("success").result()


def test_embedded_checkpoint_listing_has_a_cursor(embedded_service: Any) -> None:
    """Before: `list_user_checkpoints().cursor` was None on the embedded engine."""
    clients = _clients(__import__("tinker_sr"), embedded_service)
    clients.training.save_state("a").result()
    clients.training.save_state("b").result()
    listing = clients.rest.list_user_checkpoints(limit=1).result()
    assert listing.cursor is not None and listing.cursor.total_count == 2
    assert (listing.cursor.offset, listing.cursor.limit, len(listing.checkpoints)) == (0, 1, 1)
