"""Concurrent sample requests through the clients decode together (continuous batching) and
return exactly what each returns alone, embedded and over the server."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tinker_sr as tinker
from tinker_sr import types
from tinker_sr.backend.local import LocalBackend
from tinker_sr.engine import scheduler


def calls(n: int = 10) -> list[dict[str, Any]]:
    """Different prompts, lengths, row counts, sampling settings, stops and extras."""
    out = []
    for i in range(n):
        stop: Any = [] if i % 3 == 0 else (list(range(100, 100 + 8 * i)) if i % 3 == 1 else "e")
        out.append(
            dict(
                prompt=types.ModelInput.from_ints(list(b"batch " * (1 + i % 4))[: 5 + 3 * i]),
                num_samples=1 + (5 * i) % 8,
                sampling_params=types.SamplingParams(
                    max_tokens=4 + 2 * i,
                    temperature=(1.0, 0.8, 0.0, 1.2)[i % 4],
                    top_k=(-1, 30)[i % 2],
                    top_p=(1.0, 0.9)[i % 2],
                    seed=10 + i,
                    stop=stop,
                ),
                topk_sample_logprobs=i % 3,
                include_prompt_logprobs=i % 4 == 1,
            )
        )
    return out


def summary(res: types.SampleResponse) -> Any:
    seqs = [
        (
            s.tokens,
            s.logprobs,
            s.stop_reason,
            s.topk_logprobs,
        )
        for s in res.sequences
    ]
    lps = res.prompt_logprobs
    return seqs, None if lps is None else [x for x in lps if x is not None]


def samplers(service: tinker.ServiceClient) -> list[Any]:
    """A LoRA sampler recording stability info, and a base-model sampler (another model)."""
    tc = service.create_lora_training_client("tinker-sr/tiny", rank=4, seed=2).result()
    lora = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    base = service.create_sampling_client(base_model="tinker-sr/tiny").result()
    return [lora, base]


def test_concurrent_requests_equal_requests_one_at_a_time(service: tinker.ServiceClient) -> None:
    clients = samplers(service)
    work = [(clients[i % 2], kw) for i, kw in enumerate(calls())]
    alone = [summary(sc.sample(**kw).result()) for sc, kw in work]
    futures = [sc.sample(**kw) for sc, kw in work]  # all in flight at once
    together = [summary(f.result()) for f in futures]
    assert together == alone
    assert any(s[2] == "stop" for seqs, _ in alone for s in seqs)


def alone_then_together(tmp_path: Path, n: int) -> tuple[Any, Any, list[int], list[int]]:
    """``calls(n)`` on a fresh embedded engine one at a time, then all at once: both
    results and the rows of each decode step of either phase."""
    backend = LocalBackend(tmp_path)
    service = tinker.ServiceClient(backend=backend)
    rows = backend._scheduler.rows_per_step
    try:
        sc = service.create_sampling_client(base_model="tinker-sr/tiny").result()
        work = calls(n)
        alone = [summary(sc.sample(**kw).result()) for kw in work]
        solo_steps = list(rows)
        rows.clear()
        # Hold the worker until every request is queued, so they are in flight together
        # however the threads are scheduled.
        held, gate = threading.Event(), threading.Event()
        backend._scheduler.barrier(lambda: (held.set(), gate.wait(60)))
        held.wait(60)
        futures = [sc.sample(**kw) for kw in work]
        while backend._scheduler.queued() < len(work):
            time.sleep(0.002)
        gate.set()
        together = [summary(f.result()) for f in futures]
        return alone, together, solo_steps, list(rows)
    finally:
        service.close().result()
        backend.close()


def test_requests_decode_in_shared_steps_within_the_row_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(scheduler.MAX_ROWS_ENV, "12")
    alone, together, solo_steps, steps = alone_then_together(tmp_path, 8)
    assert together == alone
    assert max(solo_steps) <= 8  # alone: at most one request's rows per step
    assert 8 < max(steps) <= 12  # together: rows of several requests, within the cap
    assert len(steps) < len(solo_steps)


def test_kv_cache_budget_makes_requests_wait_their_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no room for a second request's KV cache, requests decode one after another:
    still the same results."""
    monkeypatch.setenv(scheduler.CACHE_BUDGET_ENV, "0")
    alone, together, _, steps = alone_then_together(tmp_path, 8)
    assert together == alone
    assert max(steps) <= 8


def test_the_sampling_thread_stops_mid_decode_at_interpreter_exit(tmp_path: Path) -> None:
    """At exit the sampling thread stops after its current step (`abandon`, run by an atexit
    hook) instead of decoding on while the interpreter finalizes: a daemon thread still
    inside torch then was killed as it retook the GIL, which aborted the process."""
    backend = LocalBackend(tmp_path / "store")
    client = tinker.ServiceClient(backend=backend)
    sc = client.create_sampling_client(base_model="tinker-sr/tiny").result()
    long = sc.sample(
        types.ModelInput.from_ints(list(b"a long one")),
        num_samples=8,
        sampling_params=types.SamplingParams(max_tokens=480, temperature=1.0, seed=1, stop=[]),
    )
    worker = backend._scheduler
    deadline = time.monotonic() + 60
    while not worker.rows_per_step and time.monotonic() < deadline:  # decoding has begun
        time.sleep(0.01)
    assert worker.rows_per_step, "the request never started decoding"
    # The thread reads the flag under this lock before each step, so counting and flagging
    # under it leaves no window in which it decodes on (a busy machine once fitted 7 steps
    # between a count and the flag taken separately). The re-entrant lock lets `abandon` set
    # the flag here; it waits for the thread only after the lock is released.
    with worker._cond:
        before = len(worker.rows_per_step)
        worker.abandon(timeout=0)
    scheduler._abandon_at_exit()  # what the atexit hook runs: every live thread, joined
    assert not worker._thread.is_alive()
    # Only the step under way when the flag was set finished; the request stays unanswered.
    assert len(worker.rows_per_step) <= before + 1 < 100
    assert not long.future().done()
    backend.close()


def test_a_script_that_never_closes_its_clients_exits_cleanly(tmp_path: Path) -> None:
    """The user's view of the test above: sample, then let the interpreter exit with the
    clients open (as most scripts do). Before the atexit hook this ended with `terminate
    called without an active exception` and exit status 134 in about half the runs of a
    42M-parameter model, ~1 in 8 on this small one."""
    import subprocess
    import sys

    script = (
        "import tinker_sr as tinker\n"
        "sc = tinker.ServiceClient().create_lora_training_client(base_model='tinker-sr/small',"
        " rank=4, seed=0).result().save_weights_and_get_sampling_client("
        "record_stability_info=True).result()\n"
        "fs = [sc.sample(tinker.types.ModelInput.from_ints([1, 2, 3, 4]), num_samples=4,"
        " sampling_params=tinker.types.SamplingParams(max_tokens=32, temperature=1.0, seed=i))"
        " for i in range(4)]\n"
        "print(sum(len(f.result().sequences) for f in fs))\n"
    )
    env = {**__import__("os").environ, "TINKER_SR_STORE": str(tmp_path / "store")}
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0 and "terminate" not in done.stderr, done.stderr[-2000:]
        assert done.stdout.strip() == "16"


def test_a_cached_prompt_is_never_another_sessions(
    service: tinker.ServiceClient, backend_kind: str, request: pytest.FixtureRequest
) -> None:
    """The prompt cache is per session: another session (on a server, another API key) on the
    same base model computes the prompt itself and learns nothing of what this one sent, not
    even through ``prompt_cache_hit_tokens``, which it is billed by (engine.usage)."""
    prompt = types.ModelInput.from_ints([5 + (i * 29) % 240 for i in range(40)])  # this test's
    params = types.SamplingParams(max_tokens=2, seed=1)
    mine = service.create_sampling_client(base_model="tinker-sr/tiny").result()
    assert mine.sample(prompt, 1, params).result().prompt_cache_hit_tokens == 0
    if backend_kind == "local":
        other = tinker.ServiceClient(backend=service.holder.backend)
    else:
        srv = request.getfixturevalue("remote_server")
        other = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-another-tenant")
    try:
        theirs = other.create_sampling_client(base_model="tinker-sr/tiny").result()
        first, again = (theirs.sample(prompt, 1, params).result() for _ in range(2))
        assert (first.prompt_cache_hit_tokens, again.prompt_cache_hit_tokens) == (0, 40)
        assert summary(first) == summary(again)  # the same tokens, computed or copied
    finally:
        other.close().result()
    assert mine.sample(prompt, 1, params).result().prompt_cache_hit_tokens == 40


def test_a_group_of_requests_for_one_prompt_prefills_it_once(
    service: tinker.ServiceClient,
    backend_kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tinker-cookbook's rollouts: one ``sample(num_samples=1)`` per group member, all on one
    prompt, in flight together. The prompt is prefilled once; the others report it as
    ``prompt_cache_hit_tokens`` (across the wire too) and sample what a prefill of their own
    gives, bit for bit (against an engine with the cache off)."""
    sc = service.create_sampling_client(base_model="tinker-sr/tiny").result()
    prompt = types.ModelInput.from_ints([7 + (i * 37) % 240 for i in range(61)])  # this test's
    params = [types.SamplingParams(max_tokens=8, seed=s, stop=[]) for s in range(4)]
    group = [f.result() for f in [sc.sample(prompt, 1, p) for p in params]]
    assert sorted(r.prompt_cache_hit_tokens for r in group) == [0, 61, 61, 61]
    again = [sc.sample(prompt, 1, p).result() for p in params]
    assert [r.prompt_cache_hit_tokens for r in again] == [61] * 4
    assert [summary(r) for r in again] == [summary(r) for r in group]
    if backend_kind != "local":
        return
    monkeypatch.setenv("TINKER_SR_PROMPT_CACHE_MB", "0")
    backend = LocalBackend(tmp_path / "off")
    off = tinker.ServiceClient(backend=backend)
    try:
        plain = off.create_sampling_client(base_model="tinker-sr/tiny").result()
        alone = [plain.sample(prompt, 1, p).result() for p in params]
        assert [r.prompt_cache_hit_tokens for r in alone] == [0] * 4
        assert [summary(r) for r in alone] == [summary(r) for r in group]
    finally:
        off.close().result()
        backend.close()


def test_closing_a_session_waits_for_its_own_samples_only(tmp_path: Path) -> None:
    """A session's close lets its own queued samples finish first, and nobody else's: it used
    to put a barrier on the sampling worker, which waited for every session's samples and held
    back all requests queued behind it (one client finishing stalled every other client)."""
    backend = LocalBackend(tmp_path)
    a, b, c = (tinker.ServiceClient(backend=backend) for _ in range(3))
    try:
        sa, sb, _ = (
            s.create_sampling_client(base_model="tinker-sr/tiny").result() for s in (a, b, c)
        )
        held, gate = threading.Event(), threading.Event()
        backend._scheduler.barrier(lambda: (held.set(), gate.wait(120)))  # the worker is busy
        held.wait(60)
        kw = calls(1)[0]
        fb, fa = sb.sample(**kw), sa.sample(**kw)
        while backend._scheduler.queued() < 2:
            time.sleep(0.002)
        c.close().result(timeout=60)  # C has nothing in flight: closed while the worker is busy
        assert not fb.future().done() and not fa.future().done()
        closing_a = a.close()
        with pytest.raises(TimeoutError):  # A's own sample is still queued
            closing_a.result(timeout=0.3)
        gate.set()
        assert summary(fa.result()) == summary(fb.result())  # A's sample ran before its close
        closing_a.result(timeout=60)
    finally:
        gate.set()
        for s in (a, b, c):
            s.close().result()
        backend.close()


def test_a_finished_sessions_cached_prompts_are_freed(tmp_path: Path) -> None:
    """Cached prefills belong to one session (no other may reuse them): once it finishes
    nothing can hit them again. They used to stay until the cache's budget pushed them out
    (256 MiB by default, ~27 MB per short session of long prompts), pushing out live
    sessions' entries first."""
    backend = LocalBackend(tmp_path)
    cache = backend._scheduler.prompt_cache
    keeper, short = tinker.ServiceClient(backend=backend), tinker.ServiceClient(backend=backend)
    try:
        params = types.SamplingParams(max_tokens=2, seed=0)
        scopes = []
        for service in (keeper, short):
            sc = service.create_sampling_client(base_model="tinker-sr/tiny").result()
            for i in range(3):
                prompt = types.ModelInput.from_ints([(7 * j + i) % 250 + 1 for j in range(300)])
                sc.sample(prompt, 1, params).result()
            scopes.append({key[2] for key in cache._entries})
        assert len(scopes[0]) == 1 and len(scopes[1]) == 2
        held = cache._bytes
        short.close().result()
        assert {key[2] for key in cache._entries} == scopes[0]
        assert 0 < cache._bytes < held  # the keeper's entries stay
    finally:
        keeper.close().result()
        short.close().result()
        backend.close()


async def _samplers_of_two_sessions(backend: LocalBackend) -> list[str]:
    """A base-model sampler in each of two new sessions of ``backend``."""
    samplers = []
    for _ in range(2):
        session = await backend.create_session()
        samplers.append(
            await backend.create_sampling_session(session, 0, base_model="tinker-sr/tiny")
        )
    return samplers


def test_sessions_take_turns_when_requests_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows for one request at a time (``$TINKER_SR_MAX_DECODE_ROWS=4``); session A queues six
    4-row requests, then session B one. B is admitted at the next free turn, after at most two
    of A's (the first may be admitted before the rest arrive), instead of after all six (a
    server's one client with a burst held every other client's samples until it had all
    decoded). Its samples are those it gets alone."""
    import asyncio

    monkeypatch.setenv(scheduler.MAX_ROWS_ENV, "4")
    params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=5)
    prompt = types.ModelInput.from_ints([3, 4, 5])

    async def run() -> tuple[list[str], Any, Any]:
        backend = LocalBackend(tmp_path / "store")
        try:
            samplers = await _samplers_of_two_sessions(backend)
            done: list[str] = []

            async def sample(who: str, sampler: str, seq: int) -> Any:
                out = await backend.sample(
                    sampler, seq, prompt=prompt, num_samples=4, sampling_params=params
                )
                done.append(who)
                return out

            # Submitted in this order in one turn of the loop: A's six, then B's.
            tasks = [asyncio.ensure_future(sample("A", samplers[0], i)) for i in range(6)]
            b = asyncio.ensure_future(sample("B", samplers[1], 0))
            await asyncio.gather(*tasks, b)
            alone = await backend.sample(
                samplers[1], 1, prompt=prompt, num_samples=4, sampling_params=params
            )
            return done, b.result(), alone
        finally:
            await backend.aclose()

    order, b, alone = asyncio.run(run())
    assert order.index("B") <= 2, order
    assert [s.tokens for s in b.sequences] == [s.tokens for s in alone.sequences]


def test_a_small_request_joins_beside_one_too_large_to_join_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hunt (a shared server): rows for 8; session A decodes a 6-row request with
    another queued, which cannot join (6 + 6 > 8). Session B's 2-row request fits beside the
    first, and now joins at once; before, it waited behind A's queued one until A's first had
    finished (B's p95 3.8 s instead of 0.6 s in the hunt). A's queued request still starts as
    soon as its first finishes (backfill stays within the rows it leaves)."""
    import asyncio
    import threading

    monkeypatch.setenv(scheduler.MAX_ROWS_ENV, "8")
    long = types.SamplingParams(max_tokens=300, temperature=1.0, seed=5, stop=[])
    short = types.SamplingParams(max_tokens=4, temperature=1.0, seed=6, stop=[])
    prompt = types.ModelInput.from_ints([3, 4, 5])
    decoding = threading.Event()

    async def run() -> tuple[list[str], Any, Any]:
        backend = LocalBackend(tmp_path / "store")
        try:
            samplers = await _samplers_of_two_sessions(backend)
            done: list[str] = []

            async def sample(who: str, sampler: str, seq: int, n: int, params: Any) -> Any:
                out = await backend.sample(
                    sampler, seq, prompt=prompt, num_samples=n, sampling_params=params,
                    progress=lambda rows: decoding.set(),
                )  # fmt: skip
                done.append(who)
                return out

            a = [asyncio.ensure_future(sample("A", samplers[0], i, 6, long)) for i in range(2)]
            await asyncio.to_thread(decoding.wait, 60)  # A's first decodes, its second waits
            b = await sample("B", samplers[1], 0, 2, short)
            await asyncio.gather(*a)
            alone = await backend.sample(
                samplers[1], 1, prompt=prompt, num_samples=2, sampling_params=short
            )
            return done, b, alone
        finally:
            await backend.aclose()

    order, b, alone = asyncio.run(run())
    assert order == ["B", "A", "A"], order
    assert [s.tokens for s in b.sequences] == [s.tokens for s in alone.sequences]
