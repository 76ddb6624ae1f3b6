"""A ``forward`` / ``forward_backward`` of many datums runs in the official SDK's chunks on
every backend (`tinker_sr.clients.chunks`), so its metrics are the official SDK's for it: the
SDK sends more than 1024 datums (or ~5 MB) as several requests and merges their ``:mean``
metrics weighted by datums. Before, an embedded call ran whole and reported per-token means
where the official SDK against `tinker-sr serve` reported the chunks' weighted ones (the sign
of ``kl_sampler_learner:mean`` differed on the batch below)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tinker
from tinker.lib import chunked_fwdbwd_helpers as sdk_chunks
from tinker.lib.public_interfaces import training_client as sdk_training

import tinker_sr
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.clients import chunks


def _batch(t: Any, n: int = 1100) -> list[Any]:
    """n datums for ppo in module ``t``'s types (tinker or tinker_sr): 1024 short ones, then
    longer ones whose sampler log-probs differ, so per-token and per-datum means differ."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        length = 2 if i < 1024 else 30
        toks = rng.integers(0, 250, length + 1)
        inputs = {
            "target_tokens": t.TensorData.from_numpy(toks[1:].astype(np.int64)),
            "logprobs": t.TensorData.from_numpy(
                np.full(length, -5.0 - 2 * (i >= 1024), np.float32)
            ),  # fmt: skip
            "advantages": t.TensorData.from_numpy(np.ones(length, np.float32)),
        }
        out.append(t.Datum(model_input=t.ModelInput.from_ints(toks[:-1].tolist()), loss_fn_inputs=inputs))  # fmt: skip
    return out


def _run(service: Any, t: Any) -> tuple[dict[str, float], list[list[float]]]:
    training = service.create_lora_training_client(base_model="tinker-sr/tiny", rank=4, seed=0)
    out = training.result().forward_backward(_batch(t), "ppo").result()
    return dict(out.metrics), [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs]


def test_a_large_call_reports_the_official_sdks_metrics(tmp_path: Any, remote_server: Any) -> None:
    """1100 datums: the official SDK against the server, tinker_sr embedded and tinker_sr
    against the server report the same metrics and outputs, bit for bit: each sends the call
    as two requests (one whole request would report per-token means, checked last)."""
    official = tinker.ServiceClient(base_url=remote_server.base_url, api_key="tml-chunks")
    backend = LocalBackend(tmp_path / "store")
    embedded = tinker_sr.ServiceClient(backend=backend)
    remote = tinker_sr.ServiceClient(base_url=remote_server.base_url, api_key="tml-chunks")
    try:
        want = _run(official, tinker)
        assert _run(embedded, tinker_sr) == want
        assert _run(remote, tinker_sr) == want
    finally:
        official.holder.close()
        embedded.close().result()
        remote.close().result()
        backend.close()
    metrics, outputs = want
    assert len(outputs) == 1100 and metrics["kl_sampler_learner:mean"] > 0  # the chunks' means
    lq = np.concatenate([[-5.0] * 2] * 1024 + [[-7.0] * 30] * 76)
    per_token = float(np.mean(lq - np.concatenate(outputs)))
    assert per_token < 0  # what one whole request reports: not what the official SDK does


def _sdk_chunks(data: list[Any], max_len: int, max_bytes: int) -> list[int]:
    """The official SDK's own chunk sizes for ``data`` (its generator, on a stand-in client)."""
    client = object.__new__(sdk_training.TrainingClient)
    config = tinker.types.ClientConfigResponse(
        fwdbwd_max_chunk_len=max_len, fwdbwd_max_chunk_bytes_count=max_bytes
    )
    client.holder = type("Holder", (), {"_client_config": config})()  # type: ignore[assignment]
    return [len(c.data) for c in client._chunked_requests_generator(data)]


@pytest.mark.parametrize("limits", [(1024, 5_000_000), (3, 5_000_000), (1024, 300), (2, 60)])
def test_chunks_are_cut_where_the_sdk_cuts_them(limits: tuple[int, int]) -> None:
    """Datums of several sizes (and an image chunk, whose bytes count as they are): the same
    byte estimate per datum and the same cuts as the SDK's, at its defaults and tighter
    limits (a datum over the byte limit is a chunk alone)."""
    rng = np.random.default_rng(1)
    sizes = [int(n) for n in rng.integers(1, 40, 30)]

    def datums(t: Any) -> list[Any]:
        out = []
        for i, n in enumerate(sizes):
            chunks_in = [t.EncodedTextChunk(tokens=list(range(n)))]
            if i % 7 == 3:
                chunks_in.append(t.ImageChunk(data=b"\x89PNG" * (i + 1), format="png"))
            weights = t.TensorData.from_numpy(np.ones(n, np.float32))
            out.append(t.Datum(model_input=t.ModelInput(chunks=chunks_in), loss_fn_inputs={"weights": weights}))  # fmt: skip
        return out

    ours, theirs = datums(types), datums(tinker.types)
    assert [chunks.estimated_bytes(d) for d in ours] == [
        sdk_training._estimate_datum_bytes_count_proto(d) for d in theirs
    ]
    assert [len(c) for c in chunks.split(ours, *limits)] == _sdk_chunks(theirs, *limits)


def test_chunks_combine_as_the_sdk_combines_them() -> None:
    """Every reduction the SDK knows (a mean weighted by datums, sums, extremes, slack, hash2,
    unique), a metric of an unknown kind left out, a metric one chunk lacks left out, outputs
    joined in order: the SDK's own combination, bit for bit; one chunk goes through it too."""
    rng = np.random.default_rng(2)
    keys = ["a:mean", "b:sum", "c:min", "d:max", "e:slack", "f:hash2", "g:unique", "h:median"]

    def results(t: Any) -> list[Any]:
        out = []
        for i, n in enumerate([3, 1, 5]):
            metrics = {k: float(rng.random() * 7 - 2) if k != "f:hash2" else float(i * 41 + 7) for k in keys}  # fmt: skip
            if i == 1:
                metrics["x:sum"] = 1.0  # in a later chunk only: the SDK reads the first's keys
            if i != 2:
                metrics["y:sum"] = 2.0  # not in the last chunk: left out
            outputs = [{"logprobs": t.TensorData.from_numpy(np.full(2, -float(i * 10 + j), np.float32))} for j in range(n)]  # fmt: skip
            out.append(t.ForwardBackwardOutput(loss_fn_output_type="t", metrics=metrics, loss_fn_outputs=outputs))  # fmt: skip
        return out

    state = rng.bit_generator.state
    ours = results(types)
    rng.bit_generator.state = state
    theirs = results(tinker.types)
    for n in (3, 1):
        got, want = chunks.combine(ours[:n]), sdk_chunks.combine_fwd_bwd_output_results(theirs[:n])
        assert got.metrics == want.metrics and "h:median" not in got.metrics
        assert got.loss_fn_output_type == want.loss_fn_output_type
        assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == [
            o["logprobs"].tolist() for o in want.loss_fn_outputs
        ]
    every = chunks.combine(ours).metrics
    assert "g:unique_2" in every and "x:sum" not in every and "y:sum" not in every
    assert chunks.combine(ours[:2]).metrics["y:sum"] == 4.0
