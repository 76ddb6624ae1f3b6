"""Sampling endpoints: create a sampling session, look one up, and asample."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from tinker_sr import validation
from tinker_sr.limits import DEFAULT_LIMITS, Limits
from tinker_sr.wire import messages as m
from tinker_sr.wire import proto

from ..http import HTTPError, body_hash, json_reply

if TYPE_CHECKING:
    from ..app import TinkerServer


async def create_sampling_session(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, body = await srv.parse(request, m.CreateSamplingSessionRequest, "create_sampling_session")
    srv.sessions.session(req.session_id, owner)
    if req.model_path is None and req.base_model is None:
        raise HTTPError(400, "create_sampling_session: send model_path or base_model")
    if req.model_path is not None:
        await srv.sessions.readable_checkpoint(req.model_path, owner, field="model_path")
    key = f"sampling_session|{req.session_id}|{req.sampling_session_seq_id}"
    earlier = srv.state.reply(owner, key)
    if earlier is not None:
        if earlier[0] != body_hash(body):
            raise HTTPError(
                400,
                f"sampling_session_seq_id {req.sampling_session_seq_id} "
                f"is already used in session {req.session_id}",
            )
        return json_reply(earlier[1])
    sampler_id = await srv.backend.create_sampling_session(
        req.session_id,
        req.sampling_session_seq_id,
        base_model=req.base_model,
        model_path=req.model_path,
    )
    if srv.unseeded is not None:
        srv.unseeded.sampler(sampler_id, req.session_id, req.sampling_session_seq_id)
    reply = {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
    try:
        srv.state.add_sampler(sampler_id, req.session_id, req.model_path)
        srv.state.save_reply(owner, key, body_hash(body), reply)
    except BaseException:
        # Not recorded (a full disk, say): forget the engine's sampler too, so the SDK's retry
        # of this request creates it again rather than finding its number "already used".
        release = getattr(srv.backend, "release_sampler", None)
        if release is not None:
            await release(sampler_id)
        raise
    return json_reply(reply)


async def get_sampler(srv: TinkerServer, request: Request, owner: str) -> Response:
    sampler_id = request.path_params["sampler_id"]
    row = srv.state.sampler_session(sampler_id)
    if row is None or row.owner != owner:
        raise HTTPError(404, f"unknown sampler {sampler_id!r}")
    srv.sessions.check_loaded_sampler(sampler_id)  # its record outlived a restart; not it
    base_model = await srv.backend.get_sampler_base_model(sampler_id)
    out = {"sampler_id": sampler_id, "base_model": base_model}
    model_path = srv.state.sampler_model_path(sampler_id)
    if model_path:
        out["model_path"] = model_path
    # Not in the Tinker API (the official SDK ignores it): tinker_sr's client loads this
    # sampler's tokenizer by it, where a model name (an alias, a folder name) says nothing.
    if (tokenizer_id := srv.tokenizers.for_model(base_model)) is not None:
        out["tokenizer_id"] = tokenizer_id
    return json_reply(out)


def _check_sample_request(req: m.SampleRequest, limits: Limits) -> tuple[str, int]:
    """The sampler id and seq_id of a well-formed asample request."""
    if req.sampling_session_id is None:
        raise HTTPError(
            400,
            "asample: sampling_session_id is required; create a sampling "
            "client (create_sampling_session) first",
        )
    if req.base_model is not None or req.model_path is not None:
        raise HTTPError(
            400,
            "asample: base_model/model_path are not accepted here; they "
            "belong to create_sampling_session",
        )
    if req.seq_id is None:
        raise HTTPError(400, "asample: seq_id is required")
    validation.check_num_samples(req.num_samples, limits)
    return req.sampling_session_id, req.seq_id


async def asample(srv: TinkerServer, request: Request, owner: str) -> Response:
    req, body = await srv.parse(request, m.SampleRequest, "asample")
    limits = getattr(srv.backend, "limits", DEFAULT_LIMITS)
    sampler_id, seq_id = _check_sample_request(req, limits)
    session = srv.sessions.sampler(sampler_id, owner)
    # A sample that cannot fit the model's context is refused here (400, in the hosted
    # service's words, which tinker-cookbook matches), not failed later as a future.
    overflow = getattr(srv.backend, "sample_overflow", None)
    problem = (
        overflow(sampler_id, req.prompt, req.sampling_params, req.num_samples) if overflow else None
    )
    if problem is not None:
        raise HTTPError(400, problem)
    target = (
        req.target_prompt_logprobs.to_public("asample.target_prompt_logprobs")
        if req.target_prompt_logprobs is not None
        else None
    )
    n = req.num_samples
    params = req.sampling_params.to_public()
    if params.seed is None and srv.unseeded is not None:
        params = params.model_copy(update={"seed": srv.unseeded.sample(sampler_id, seq_id)})

    def promise_extra(rid: str) -> dict[str, Any]:
        # Unique within the session: the sampler id is, and so is (seq_id, request).
        return {"sample_sequence_ids": validation.sequence_ids(sampler_id, seq_id, n, rid[4:12])}

    async def work(promise: dict[str, Any]) -> tuple[str, bytes]:
        resp = await srv.backend.sample(
            sampler_id,
            seq_id,
            prompt=req.prompt,
            num_samples=n,
            sampling_params=params,
            include_prompt_logprobs=bool(req.prompt_logprobs),
            topk_prompt_logprobs=req.topk_prompt_logprobs,
            topk_sample_logprobs=req.topk_sample_logprobs if srv.features.sample_topk else 0,
            target_prompt_logprobs=target,
            prompt_alt_tokens_k=req.prompt_alt_tokens_k,
            prompt_logprobs_last_n=req.prompt_logprobs_last_n,
            # A server playing an engine without stability info drops the flag silently.
            record_stability_info=bool(req.record_stability_info)
            and srv.features.record_stability_info,
            sequence_ids=promise["sample_sequence_ids"],
        )
        if len(resp.sequences) != n:
            raise RuntimeError(f"backend returned {len(resp.sequences)} sequences for {n} samples")
        return "proto", proto.encode_sample_response(resp)

    dedupe_key = f"sample|{sampler_id}|seq_id {seq_id}"
    srv.futures.check_sample_capacity(dedupe_key, owner)
    return srv.futures.submit(
        kind="Sample",
        owner=owner,
        session_id=session.session_id,
        dedupe_key=dedupe_key,
        body=body,
        work=work,
        promise_extra=promise_extra,
    )
