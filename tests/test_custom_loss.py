"""Custom losses (spec/api.md §4.4, §9.9): ``ServiceClient.create_custom_loss`` traces a
per-datum loss into a `LossHandle`; ``forward_backward_custom`` runs it client-side."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend

MODEL = "tinker-sr/tiny"
ADAM = types.AdamParams(learning_rate=1e-2)


def _host_helper(x: Any) -> Any:  # a function outside torch/math/operator
    return x


CAPTURED = torch.ones(4)
LINEAR = torch.nn.Linear(4, 4)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[LocalBackend]:
    be = LocalBackend(tmp_path / "store")
    yield be
    be.close()


@pytest.fixture
def service(backend: LocalBackend) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(backend=backend)
    yield client
    client.close().result()


def sft_datum(text: bytes, **extra: Any) -> types.Datum:
    toks = list(text)
    inputs: dict[str, Any] = {"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)}
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={**inputs, **extra}
    )


def neg_ll(logprobs: torch.Tensor, weights: torch.Tensor) -> Any:
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss, "custom/tokens:mean": weights.sum()}


RANKS: dict[str, Any] = {"logprobs": 1, "weights": 1}


def test_handle_matches_callable_and_builtin_cross_entropy(
    service: tinker.ServiceClient,
) -> None:
    data = [sft_datum(b"custom loss"), sft_datum(b"xyz")]
    handle = service.create_custom_loss(neg_ll, RANKS).result()

    def nll_callable(batch: list[types.Datum], lps: list[torch.Tensor]) -> Any:
        losses = [
            -(lp * d.loss_fn_inputs["weights"].to_torch()).sum()
            for d, lp in zip(batch, lps, strict=True)
        ]
        return torch.stack(losses).sum(), {}

    clients = [
        service.create_lora_training_client(MODEL, rank=4, seed=0).result() for _ in range(3)
    ]
    outs = [
        clients[0].forward_backward_custom(data, handle),
        clients[1].forward_backward_custom(data, nll_callable),
        clients[2].forward_backward(data, "cross_entropy"),
    ]
    for tc in clients:
        tc.optim_step(ADAM)
    via_handle, via_callable, builtin = (f.result() for f in outs)

    ref = builtin.metrics["loss:sum"]
    assert via_handle.metrics["loss:sum"] == pytest.approx(ref, rel=1e-5)
    assert via_callable.metrics["loss:sum"] == pytest.approx(ref, rel=1e-5)
    assert via_handle.metrics["custom/neg_ll:sum"] == pytest.approx(ref, rel=1e-5)
    # ":mean" metrics average over datums (10 and 2 target tokens), ":sum" ones add up.
    assert via_handle.metrics["custom/tokens:mean"] == pytest.approx(6.0)
    assert "surrogate_loss:sum" in via_handle.metrics
    assert len(via_handle.loss_fn_outputs) == 2
    # Same gradients: after one identical Adam step every model scores the data the same.
    after = [tc.forward(data, "cross_entropy").result().metrics["loss:sum"] for tc in clients]
    assert after[0] == pytest.approx(after[2], rel=1e-4)
    assert after[1] == pytest.approx(after[2], rel=1e-4)
    assert after[2] < ref


def test_loss_handle_fields(service: tinker.ServiceClient) -> None:
    handle = service.create_custom_loss(neg_ll, RANKS).result()
    assert isinstance(handle, tinker.LossHandle)
    assert dataclasses.is_dataclass(handle)
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.name = "other"  # type: ignore[misc]
    assert handle.name == "neg_ll" and handle.loss_id is None
    assert handle.inputs == (
        types.CustomLossInput(name="logprobs", rank=1),
        types.CustomLossInput(name="weights", rank=1),
    )
    assert handle.input_names == ("weights",)
    assert isinstance(handle.graph, torch.fx.GraphModule)
    assert len(handle.key) == 64 and handle.key == handle.key
    tc = service.create_lora_training_client(MODEL, rank=4).result()
    assert tc.model_id.startswith(handle.session_id + ":")
    assert "graph" not in repr(handle)
    # Each loss is created once per session.
    with pytest.raises(ValueError, match="already created 'neg_ll'"):
        service.create_custom_loss(neg_ll, RANKS).result()


def test_scalar_and_rank2_inputs(service: tinker.ServiceClient) -> None:
    def scaled(logprobs: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor) -> Any:
        loss = -(logprobs * mask[:, 0]).sum() * scale
        return loss, {"custom/scale:mean": scale}

    handle = service.create_custom_loss(scaled, {"logprobs": 1, "scale": 0, "mask": 2}).result()
    assert handle.input_names == ("scale", "mask")
    extra = {"scale": torch.tensor(2.0), "mask": torch.tensor([[1.0], [0.0], [1.0]])}
    tc = service.create_lora_training_client(MODEL, rank=4, seed=0).result()
    ce = tc.forward([sft_datum(b"abcd")], "cross_entropy").result()
    out = tc.forward_backward_custom([sft_datum(b"abcd", **extra)], handle).result()
    lps = ce.loss_fn_outputs[0]["logprobs"].to_torch()
    assert out.metrics["loss:sum"] == pytest.approx(float(-(lps[0] + lps[2]) * 2), rel=1e-4)
    assert out.metrics["custom/scale:mean"] == 2.0


# ---- creation-time rejections (raised by the call itself, before anything is sent) ----------


def _fn(src: str) -> Callable[..., Any]:
    env: dict[str, Any] = {
        "torch": torch,
        "_host_helper": _host_helper,
        "CAPTURED": CAPTURED,
        "LINEAR": LINEAR,
    }
    exec(src, env)
    return env["loss"]  # type: ignore[no-any-return]


_OK_BODY = "    l = -(logprobs * w).sum()\n    return l, {}\n"
_MANY = ", ".join(f"x{i}" for i in range(16))

REJECTIONS: list[tuple[str, str, dict[str, int], str]] = [
    (
        "first-param",
        "def loss(lp, w):\n    return lp.sum(), {}\n",
        {"lp": 1, "w": 1},
        "first parameter",
    ),
    (
        "too-many",
        f"def loss(logprobs, {_MANY}):\n    return logprobs.sum(), {{}}\n",
        {"logprobs": 1, **{f"x{i}": 1 for i in range(16)}},
        "at most 16",
    ),
    (
        "bad-name",
        "def loss(logprobs, W):\n    return logprobs.sum(), {}\n",
        {"logprobs": 1, "W": 1},
        "'W'",
    ),
    (
        "varargs",
        "def loss(logprobs, *w):\n    return logprobs.sum(), {}\n",
        {"logprobs": 1, "w": 1},
        "positional",
    ),
    ("kwonly", "def loss(logprobs, *, w):\n" + _OK_BODY, {"logprobs": 1, "w": 1}, "positional"),
    ("default", "def loss(logprobs, w=None):\n" + _OK_BODY, {"logprobs": 1, "w": 1}, "default"),
    ("missing-rank", "def loss(logprobs, w):\n" + _OK_BODY, {"logprobs": 1}, "missing \\['w'\\]"),
    (
        "extra-rank",
        "def loss(logprobs, w):\n" + _OK_BODY,
        {"logprobs": 1, "w": 1, "v": 1},
        "unexpected \\['v'\\]",
    ),
    (
        "bad-rank",
        "def loss(logprobs, w):\n" + _OK_BODY,
        {"logprobs": 1, "w": 3},
        "input_ranks\\['w'\\]",
    ),
    ("logprobs-rank-0", "def loss(logprobs, w):\n" + _OK_BODY, {"logprobs": 0, "w": 1}, "rank 0"),
    (
        "branch",
        "def loss(logprobs, w):\n    if logprobs.sum() > 0:\n        return logprobs.sum(), {}\n"
        "    return -logprobs.sum(), {}\n",
        {"logprobs": 1, "w": 1},
        "cannot be traced",
    ),
    (
        "foreign-call",
        # torch.fx.wrap keeps _host_helper opaque: the graph records a call to it.
        "torch.fx.wrap('_host_helper')\n"
        "def loss(logprobs, w):\n    return _host_helper(logprobs).sum(), {}\n",
        {"logprobs": 1, "w": 1},
        "only call torch, math and operator",
    ),
    (
        "item",
        "def loss(logprobs, w):\n    return logprobs.sum(), {'custom/a:sum': logprobs.sum().item()}\n",
        {"logprobs": 1, "w": 1},
        r"\.item\(\)",
    ),
    (
        "numpy",
        "def loss(logprobs, w):\n    logprobs.numpy()\n" + "    return logprobs.sum(), {}\n",
        {"logprobs": 1, "w": 1},
        r"\.numpy\(\)",
    ),
    (
        "tolist",
        "def loss(logprobs, w):\n    logprobs.tolist()\n" + "    return logprobs.sum(), {}\n",
        {"logprobs": 1, "w": 1},
        r"\.tolist\(\)",
    ),
    (
        "backward",
        "def loss(logprobs, w):\n    logprobs.sum().backward()\n    return logprobs.sum(), {}\n",
        {"logprobs": 1, "w": 1},
        "backward",
    ),
    (
        "not-a-method",
        "def loss(logprobs, w):\n    return logprobs.no_such_method(), {}\n",
        {"logprobs": 1, "w": 1},
        "not a torch.Tensor method",
    ),
    (
        "captured",
        "def loss(logprobs, w):\n    return (logprobs * CAPTURED).sum(), {}\n",
        {"logprobs": 1, "w": 1},
        "captures a tensor",
    ),
    (
        "nn-module",
        "def loss(logprobs, w):\n    return LINEAR(logprobs).sum(), {}\n",
        {"logprobs": 1, "w": 1},
        "cannot be traced|module",
    ),
    (
        "not-pair",
        "def loss(logprobs, w):\n    return logprobs.sum()\n",
        {"logprobs": 1, "w": 1},
        r"\(loss, metrics\)",
    ),
    (
        "loss-not-tensor",
        "def loss(logprobs, w):\n    return 0.0, {}\n",
        {"logprobs": 1, "w": 1},
        "loss as a torch.Tensor",
    ),
    (
        "metrics-not-dict",
        "def loss(logprobs, w):\n    l = logprobs.sum()\n    return l, [l]\n",
        {"logprobs": 1, "w": 1},
        "metrics as a dict",
    ),
    (
        "metric-key",
        "def loss(logprobs, w):\n    l = logprobs.sum()\n    return l, {'loss': l}\n",
        {"logprobs": 1, "w": 1},
        "custom/<name>:sum",
    ),
    (
        "metric-upper",
        "def loss(logprobs, w):\n    l = logprobs.sum()\n    return l, {'custom/A:sum': l}\n",
        {"logprobs": 1, "w": 1},
        "custom/<name>:sum",
    ),
    (
        "metric-reduction",
        "def loss(logprobs, w):\n    l = logprobs.sum()\n    return l, {'custom/a:max': l}\n",
        {"logprobs": 1, "w": 1},
        "custom/<name>:sum",
    ),
    (
        "metric-float",
        "def loss(logprobs, w):\n    return logprobs.sum(), {'custom/a:sum': 1.0}\n",
        {"logprobs": 1, "w": 1},
        "must be torch tensors",
    ),
]


@pytest.mark.parametrize(
    ("src", "ranks", "match"), [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS]
)
def test_creation_rejects(
    service: tinker.ServiceClient, src: str, ranks: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match) as info:
        service.create_custom_loss(_fn(src), ranks)  # type: ignore[arg-type]
    assert str(info.value).startswith("create_custom_loss: loss ")


# ---- use-time checks ----------------------------------------------------------------------


def test_handle_from_another_session_is_refused(backend: LocalBackend) -> None:
    a = tinker.ServiceClient(backend=backend)
    b = tinker.ServiceClient(backend=backend)
    try:
        handle = a.create_custom_loss(neg_ll, RANKS).result()
        tc = b.create_lora_training_client(MODEL, rank=4).result()
        with pytest.raises(ValueError, match="created in session .* only be used by clients"):
            tc.forward_backward_custom([sft_datum(b"abc")], handle)
        # Nothing was submitted: the client still works.
        tc.forward([sft_datum(b"abc")], "cross_entropy").result()
    finally:
        a.close().result()
        b.close().result()


def test_inputs_are_checked_before_submission(service: tinker.ServiceClient) -> None:
    handle = service.create_custom_loss(neg_ll, RANKS).result()
    tc = service.create_lora_training_client(MODEL, rank=4).result()
    only_targets: dict[str, Any] = {"target_tokens": [2, 3]}
    no_weights = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs=only_targets
    )
    with pytest.raises(ValueError, match=r"datum\[0\] has no loss_fn_inputs\['weights'\]"):
        tc.forward_backward_custom([no_weights], handle)
    rank2 = sft_datum(
        b"abc", weights=types.TensorData(data=[1.0, 1.0], dtype="float32", shape=[1, 2])
    )
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['weights'\] has rank 2.*rank 1"):
        tc.forward_backward_custom([rank2], handle)
    tc.forward([sft_datum(b"abc")], "cross_entropy").result()  # not poisoned


def test_non_scalar_loss_fails_the_future(service: tinker.ServiceClient) -> None:
    def per_token(logprobs: torch.Tensor, weights: torch.Tensor) -> Any:
        return -(logprobs * weights), {}

    handle = service.create_custom_loss(per_token, RANKS).result()
    tc = service.create_lora_training_client(MODEL, rank=4).result()
    with pytest.raises(ValueError, match="scalar loss"):
        tc.forward_backward_custom([sft_datum(b"abcd")], handle).result()


def test_handle_with_loss_id_goes_to_the_engine_which_refuses_it(
    service: tinker.ServiceClient,
) -> None:
    handle = service.create_custom_loss(neg_ll, RANKS).result()
    uploaded = dataclasses.replace(handle, loss_id="loss-1")
    tc = service.create_lora_training_client(MODEL, rank=4).result()
    with pytest.raises(tinker.TinkerError, match="forward_backward_custom"):
        tc.forward_backward_custom([sft_datum(b"abc")], uploaded).result()


def test_the_official_sdk_draws_the_same_lines() -> None:
    """Every loss rejected here is rejected by the SDK 0.38's tracer, and vice versa."""
    sdk = pytest.importorskip("tinker.lib.public_interfaces.custom_loss")
    for case, src, ranks, _ in REJECTIONS:
        with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
            sdk.trace_loss(_fn(src), ranks, f"session-{case}")
    sdk.trace_loss(neg_ll, RANKS, "session")


def test_a_loss_with_a_nan_gradient_fails_before_the_backward_and_poisons(
    service: tinker.ServiceClient,
) -> None:
    """As the official SDK: a failed custom call poisons the client. Before: a NaN gradient
    went to the backward as weights, which failed naming loss_fn_inputs['weights'] (never
    passed by the caller), and the client was not poisoned."""
    tc = service.create_lora_training_client(MODEL, rank=4).result()

    def nan_loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> Any:
        return -sum(lp.sum() for lp in logprobs) * float("nan"), {}

    with pytest.raises(tinker.RequestFailedError, match="gradient of your loss.*NaN or inf") as e:
        tc.forward_backward_custom([sft_datum(b"abcd")], nan_loss).result()
    # As the SDK, the calls after it return futures that fail; they raised at the call, which
    # broke code that makes its futures first and handles errors around `.result()`.
    later = [
        tc.forward([sft_datum(b"abc")], "cross_entropy"),
        tc.optim_step(types.AdamParams(learning_rate=1e-3)),
        tc.save_state("after"),
    ]
    for future in later:
        with pytest.raises(RuntimeError, match="poisoned") as poisoned:
            future.result()
        assert poisoned.value.__cause__ is e.value  # as the SDK: chained to the first failure


def test_a_failed_backward_poisons_the_client(backend: LocalBackend) -> None:
    from tinker_sr.testing.faults import Fault, FaultyBackend, request_failed

    faulty = FaultyBackend(backend, [Fault("forward_backward", request_failed(), after=1)])
    service = tinker.ServiceClient(backend=faulty)  # type: ignore[arg-type]
    tc = service.create_lora_training_client(MODEL, rank=4).result()

    def loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> Any:
        return -sum(lp.sum() for lp in logprobs), {}

    with pytest.raises(tinker.RequestFailedError, match="injected"):  # the backward (call 2)
        tc.forward_backward_custom([sft_datum(b"abcd")], loss).result()
    with pytest.raises(RuntimeError, match="poisoned"):
        tc.forward([sft_datum(b"abc")], "cross_entropy").result()
    service.close().result()


def test_metrics_come_back_as_returned_and_must_be_a_dict(service: tinker.ServiceClient) -> None:
    """As the SDK: your metrics are added unconverted. Before: float() of each, which failed on
    a string after the backward had already accumulated its gradient."""
    tc = service.create_lora_training_client(MODEL, rank=4).result()
    note: dict[str, Any] = {"note": "a string", "count": 3}

    def loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> Any:
        return -sum(lp.sum() for lp in logprobs), note

    metrics = tc.forward_backward_custom([sft_datum(b"abcd")], loss).result().metrics
    assert metrics["note"] == "a string" and metrics["count"] == 3
    assert set(metrics) >= {"loss:sum", "surrogate_loss:sum"}
    note = None  # type: ignore[assignment]
    with pytest.raises(TypeError, match="metrics a dict"):
        tc.forward_backward_custom([sft_datum(b"abcd")], loss).result()
