"""Custom losses (alpha in the official SDK): ``ServiceClient.create_custom_loss`` traces a
per-datum loss with ``torch.fx`` into a `LossHandle`; ``forward_backward_custom`` runs it.

tinker_sr has no server-side custom losses, so every handle has ``loss_id=None`` and runs
client-side: the traced graph, not the original function, is evaluated on each datum's
logprobs, the per-datum losses are summed and the metrics reduced by their suffix.

The rules match the official SDK 0.38, so a loss accepted here is accepted there:

* the first parameter is ``logprobs``; every other one names a ``loss_fn_inputs`` key;
* names are ``[a-z_][a-z0-9_]{0,63}``, plain positional, without defaults, at most 16
  parameters in all; ``input_ranks`` gives each one's rank (0, 1 or 2);
* the function calls only torch, math and operator functions and ``torch.Tensor`` methods
  (not ``backward``, ``item``, ``numpy``, ``tolist``), uses no ``torch.nn`` modules and
  captures no tensors;
* it returns ``(loss, metrics)``: a tensor and a dict of tensors keyed
  ``custom/<name>:sum`` or ``custom/<name>:mean``.
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate

from tinker_sr import types
from tinker_sr.errors import RequestFailedError

if TYPE_CHECKING:
    import torch
    import torch.fx

__all__ = ["LossHandle", "PerDatumLossFn"]

PerDatumLossFn = Callable[
    Concatenate["torch.Tensor", ...],
    tuple["torch.Tensor", Mapping[str, "torch.Tensor"]],
]
"""``fn(logprobs, *inputs) -> (scalar loss, {"custom/<name>:sum|mean": scalar tensor})``,
called once per datum with the tensors of the ``loss_fn_inputs`` keys it names."""

MAX_PARAMETERS = 16  # logprobs included, as in the SDK
_PARAM_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(?:sum|mean)")
# ``operator`` functions that fx records for Python arithmetic live in ``_operator``.
_ALLOWED_MODULE_ROOTS = frozenset({"torch", "math", "operator", "_operator"})
_LEAVES_TORCH = frozenset({"item", "numpy", "tolist"})


@dataclass(frozen=True)
class LossHandle:
    """A traced custom loss from ``ServiceClient.create_custom_loss``; pass it to
    ``TrainingClient.forward_backward_custom`` in place of a callable."""

    name: str
    inputs: tuple[types.CustomLossInput, ...]
    """``logprobs`` first, then each ``loss_fn_inputs`` key the loss reads, with its rank."""

    session_id: str
    """The session that created the loss; only clients of that session may use it."""

    graph: torch.fx.GraphModule = field(repr=False, compare=False)
    """The traced loss; this is what runs."""

    loss_id: str | None = None
    """The server's id for an uploaded loss; ``None`` (always, in tinker_sr): runs here."""

    @property
    def key(self) -> str:
        """Digest of the traced code and inputs: a session creates each loss once."""
        h = hashlib.sha256(self.graph.code.encode())
        for loss_input in self.inputs:
            h.update(f"\0{loss_input.name}:{loss_input.rank}".encode())
        return h.hexdigest()

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys the loss reads, in parameter order."""
        return tuple(i.name for i in self.inputs[1:])


def _name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


def _fail(fn_name: str, msg: str) -> ValueError:
    return ValueError(f"create_custom_loss: {fn_name} {msg}")


def _declared_inputs(
    fn: Callable[..., Any], input_ranks: Mapping[str, int]
) -> tuple[types.CustomLossInput, ...]:
    name = _name_of(fn)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise _fail(name, f"has no inspectable signature ({e}); pass a Python function") from e
    if not params or params[0].name != "logprobs":
        raise _fail(
            name,
            "must take `logprobs` as its first parameter, then one parameter per "
            "loss_fn_inputs key it reads, e.g. def loss(logprobs, advantages)",
        )
    if len(params) > MAX_PARAMETERS:
        raise _fail(
            name,
            f"takes {len(params)} parameters; a custom loss takes at most {MAX_PARAMETERS}, "
            "logprobs included",
        )
    for p in params:
        if not _PARAM_NAME.fullmatch(p.name):
            raise _fail(
                name,
                f"parameter {p.name!r} must match [a-z_][a-z0-9_]{{0,63}} (it names a "
                "loss_fn_inputs key); rename it",
            )
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise _fail(
                name,
                f"parameter {p.name!r} must be a plain positional parameter; *args, **kwargs "
                "and keyword-only parameters are not supported",
            )
        if p.default is not p.empty:
            raise _fail(
                name,
                f"parameter {p.name!r} has a default; remove it (every parameter after "
                "logprobs names a required loss_fn_inputs key)",
            )
    names = [p.name for p in params]
    if set(input_ranks) != set(names):
        missing = sorted(set(names) - set(input_ranks))
        extra = sorted(set(input_ranks) - set(names))
        raise _fail(
            name,
            f"needs input_ranks with exactly one rank per parameter ({', '.join(names)}); "
            f"missing {missing}, unexpected {extra}",
        )
    for n in names:
        rank = input_ranks[n]
        if isinstance(rank, bool) or rank not in (0, 1, 2):
            raise _fail(
                name,
                f"input_ranks[{n!r}] is {rank!r}; use 0 (scalar), 1 ([T]) or 2 ([T, K])",
            )
    if input_ranks["logprobs"] == 0:
        raise _fail(
            name,
            "declares logprobs with rank 0; logprobs has the rank of target_tokens: 1 ([T]) "
            "or 2 ([T, K])",
        )
    return tuple(types.CustomLossInput(name=n, rank=input_ranks[n]) for n in names)  # type: ignore[arg-type]


def _check_graph(fn_name: str, gm: torch.fx.GraphModule) -> None:
    import torch

    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            module = str(getattr(target, "__module__", None) or "")
            if target is not builtins.getattr and module.split(".")[0] not in (
                _ALLOWED_MODULE_ROOTS
            ):
                what = getattr(target, "__qualname__", repr(target))
                raise _fail(
                    fn_name,
                    f"calls {what!r} from module {module or '<unknown>'!r}; a custom loss may "
                    "only call torch, math and operator functions",
                )
        elif node.op == "call_method":
            method = str(node.target)
            if not hasattr(torch.Tensor, method):
                raise _fail(fn_name, f"calls .{method}(), which is not a torch.Tensor method")
            if method == "backward":
                raise _fail(
                    fn_name,
                    "calls .backward(); return the loss instead: forward_backward_custom runs "
                    "the backward pass",
                )
            if method in _LEAVES_TORCH:
                raise _fail(
                    fn_name,
                    f"calls .{method}(), which leaves torch; keep every value, metrics "
                    "included, as a tensor",
                )
        elif node.op == "call_module":
            raise _fail(
                fn_name,
                f"calls the module {node.target!r}; torch.nn modules are not allowed, use "
                "functions such as torch.nn.functional instead",
            )
        elif node.op == "get_attr":
            raise _fail(
                fn_name,
                f"captures a tensor from outside the function ({node.target!r}); a custom loss "
                "may only read logprobs and the loss_fn_inputs it names (build constants "
                "inside it, e.g. with torch.tensor or torch.full_like)",
            )
        elif node.op == "output":
            _check_output(fn_name, node.args[0])


def _check_output(fn_name: str, out: Any) -> None:
    import torch.fx

    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise _fail(fn_name, "must return a (loss, metrics) pair")
    loss, metrics = out
    if not isinstance(loss, torch.fx.Node):
        raise _fail(
            fn_name,
            f"must return its loss as a torch.Tensor computed from its inputs, got {loss!r}",
        )
    if not isinstance(metrics, dict):
        raise _fail(fn_name, f"must return its metrics as a dict, got {type(metrics).__name__}")
    for key, value in metrics.items():
        if not isinstance(key, str) or not _METRIC_KEY.fullmatch(key):
            raise _fail(
                fn_name,
                f"returns metric {key!r}; name metrics custom/<name>:sum or custom/<name>:mean "
                "(<name>: 1-64 of [a-z0-9_./-]); the suffix says how datums combine",
            )
        if not isinstance(value, torch.fx.Node):
            raise _fail(
                fn_name, f"returns metric {key!r} as {value!r}; metrics must be torch tensors"
            )


def trace_loss(
    fn: PerDatumLossFn, input_ranks: Mapping[str, types.CustomLossInputRank], session_id: str
) -> LossHandle:
    """Validate and trace ``fn``; raise ``ValueError`` naming the rule it breaks."""
    try:
        import torch.fx
    except ImportError as e:  # pragma: no cover - torch is a dependency of tinker_sr
        raise ImportError("create_custom_loss needs PyTorch; install torch") from e
    name = _name_of(fn)
    inputs = _declared_inputs(fn, input_ranks)
    try:
        gm = torch.fx.symbolic_trace(fn)
    except Exception as e:
        raise _fail(
            name,
            f"cannot be traced by torch.fx ({type(e).__name__}: {e}); a custom loss cannot "
            "branch on tensor values or call libraries other than torch and math",
        ) from e
    _check_graph(name, gm)
    return LossHandle(name=name, inputs=inputs, session_id=session_id, graph=gm)


# Losses created per session (by owner: the ServiceClient's holder), keyed by LossHandle.key.
_created: weakref.WeakKeyDictionary[Any, dict[str, LossHandle]] = weakref.WeakKeyDictionary()
_created_lock = threading.Lock()


def register_loss(owner: object, handle: LossHandle) -> None:
    """Record ``handle`` for ``owner``'s session; a second identical loss is an error."""
    with _created_lock:
        known = _created.setdefault(owner, {})
        prior = known.get(handle.key)
        if prior is not None:
            raise ValueError(
                f"create_custom_loss: this session already created {prior.name!r} with the "
                "same traced loss; reuse its LossHandle"
            )
        known[handle.key] = handle


def _rank(tensor: types.TensorData) -> int:
    return 1 if tensor.shape is None else len(tensor.shape)


def check_loss_inputs(handle: LossHandle, data: Sequence[types.Datum]) -> None:
    """Raise ``ValueError`` unless every datum carries each input of ``handle`` at its
    declared rank; ``logprobs`` takes the rank of the datum's ``target_tokens``."""
    logprobs, *rest = handle.inputs
    wanted = [("target_tokens", logprobs), *((i.name, i) for i in rest)]
    for i, datum in enumerate(data):
        for key, declared in wanted:
            tensor = datum.loss_fn_inputs.get(key)
            if tensor is None:
                raise ValueError(
                    f"datum[{i}] has no loss_fn_inputs[{key!r}], which loss {handle.name!r} "
                    f"reads; add it to every datum"
                )
            rank = _rank(tensor)
            if rank != declared.rank:
                raise ValueError(
                    f"datum[{i}] loss_fn_inputs[{key!r}] has rank {rank}, but loss "
                    f"{handle.name!r} declared {declared.name} with rank {declared.rank}"
                )


def run_loss_handle(
    handle: LossHandle, data: Sequence[types.Datum], logprobs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run ``handle`` on each datum (``data`` passed `check_loss_inputs`): the losses are
    summed; ``:sum`` metrics are summed and ``:mean`` metrics averaged over the datums."""
    import torch

    if len(data) != len(logprobs):
        raise ValueError(f"{len(data)} datums but {len(logprobs)} logprob tensors")
    total: torch.Tensor | None = None
    sums: dict[str, float] = {}
    for datum, lp in zip(data, logprobs, strict=True):
        args = [datum.loss_fn_inputs[k].to_torch() for k in handle.input_names]
        loss, metrics = handle.graph(lp, *args)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss {handle.name!r} must return a scalar loss per datum, got {shape}; "
                "reduce it, e.g. with .sum()"
            )
        total = loss if total is None else total + loss
        for key, value in metrics.items():
            v = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            if v.numel() != 1:
                raise ValueError(
                    f"loss {handle.name!r} metric {key!r} must be a scalar, got shape "
                    f"{tuple(v.shape)}"
                )
            sums[key] = sums.get(key, 0.0) + float(v)
    assert total is not None, "run_loss_handle needs at least one datum"
    n = len(data)
    return total, {k: v / n if k.endswith(":mean") else v for k, v in sums.items()}


def ce_copy(d: types.Datum, weights: types.TensorData | None) -> types.Datum:
    """``d`` as a cross-entropy datum: its targets with ``weights`` (zeros when None)."""
    targets = d.loss_fn_inputs["target_tokens"]
    if weights is None:
        weights = d.loss_fn_inputs.get("weights")
    if weights is None:
        import numpy as np

        shape = targets.to_numpy().shape
        weights = types.TensorData.from_numpy(np.zeros(shape, dtype=np.float32))
    return types.Datum(
        model_input=d.model_input,
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
        model_input_spans=d.model_input_spans,
        loss_fn_input_spans=d.loss_fn_input_spans,
    )


def custom_backward_data(
    data: list[types.Datum],
    compute: Callable[..., tuple[torch.Tensor, Any]],
    fwd: types.ForwardBackwardOutput,
) -> tuple[float, Mapping[str, Any], list[types.Datum]]:
    """Runs the user's loss on the forward pass's logprobs; returns the loss, its metrics and
    the backward pass's datums (cross-entropy weighted by minus d loss / d logprobs)."""
    logprobs = [
        out["logprobs"].to_torch().float().clone().requires_grad_(True)
        for out in fwd.loss_fn_outputs
    ]
    loss, user_metrics = compute(data, logprobs)
    if not isinstance(user_metrics, Mapping):
        raise TypeError(
            "forward_backward_custom: your loss function must return (loss, metrics) with "
            f"metrics a dict of name -> value, got metrics of type {type(user_metrics).__name__}"
        )
    loss.backward()
    grads = []
    for i, lp in enumerate(logprobs):
        if lp.grad is None:
            raise ValueError("No gradient computed for logprob tensor")
        if not bool(lp.grad.isfinite().all()):
            raise RequestFailedError(
                f"Request failed: forward_backward_custom: the gradient of your loss with "
                f"respect to datum {i}'s logprobs contains NaN or inf (it would be the backward "
                "pass's weights); check the loss for NaN/inf (log of 0, division by 0)",
                request_id="",
                category=types.RequestErrorCategory.User,
            )
        grads.append(-lp.grad)
    bwd_data = [
        ce_copy(d, types.TensorData.from_torch(g)) for d, g in zip(data, grads, strict=True)
    ]
    return float(loss.detach()), user_metrics, bwd_data
