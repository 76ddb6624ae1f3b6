"""Hostile HTTP requests for a tinker_sr server, for the fuzz tests and ``benchmarks/soak.py``.

`route_table` reads the routes from the app itself, so a new endpoint is attacked the day it
is added. `Adversary(seed, ids)` then makes requests for every route, reproducibly: valid
bodies with one field broken (wrong type, extreme number, deep nesting, lone surrogate, NUL,
huge or empty string), random JSON, raw bytes, protobuf garbage, and query/path values such
as ``²``, ``-1``, ``10**30`` or ``../..``. A server passes if it answers every one with a
status below 500 and keeps serving.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AttackRequest", "Adversary", "judge", "route_table", "send"]

_EVIL_STRINGS = [
    "",
    "\x00",
    "a\x00b",
    "\ud800",
    "é" * 200,
    "../../etc/passwd",
    "/",
    "tinker://",
    "tinker://x/weights/../../y",
    "x" * 5000,
    "²",
    "٣",
    "NaN",
    " 1",
    "%00",
    "😀",
]
_EVIL_NUMBERS: list[Any] = [
    -1,
    0,
    2**31,
    2**63,
    -(2**63) - 1,
    10**30,
    1e300,
    -1e300,
    1e-300,
    5e-324,
    3e38,
    0.5,
    True,
    float("inf"),
    float("-inf"),
    float("nan"),
]
_QUERY_VALUES = ["²", "-1", "1e3", "10" * 15, "", "0", "5", "abc", "\x00", "1.5", "٣"]
_QUERY_VALUES += [  # times (the usage window): out of range, off the hour, far, zoned, dates
    "0001-01-01T00:00:00+05:00",
    "9999-12-31T23:00:00-05:00",
    "2026-01-01T00:00:00Z",
    "2026-01-01T00:30:00+00:30",
    "2025-12-31",
    "2026-13-01T00:00:00Z",
]
_QUERY_NAMES = [
    "limit",
    "offset",
    "access_scope",
    "x",
    "starting_on",
    "ending_before",
    "project_id",
]
_ROUTE_PARAMS = ["x", "", "..", "a\x00b", "é" * 200, "%2e%2e", "sess-0:train:0", "ü" * 3]


@dataclass(frozen=True)
class AttackRequest:
    method: str
    path: str
    body: bytes | None = None
    content_type: str = "application/json"
    what: str = ""


def route_table(app: Any) -> list[tuple[str, str]]:
    """``(method, path template)`` for every route of a Starlette ``app``, HEAD excluded."""
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def _valid_bodies(ids: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A plausible body per JSON endpoint, built on real ids, for one-field mutations."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    sid, mid = ids.get("session_id", "sess-x"), ids.get("model_id", "sess-x:train:0")
    path = ids.get("checkpoint", "tinker://x/weights/y")
    return {
        "/create_session": {"tags": ["a"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0"},
        "/session_heartbeat": {"session_id": sid},
        "/create_model": {
            "session_id": sid,
            "model_seq_id": 900,
            "base_model": "tinker-sr/tiny",
            "lora_config": {"rank": 4},
        },
        "/get_info": {"model_id": mid},
        "/optim_step": {"model_id": mid, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
        "/save_weights": {"model_id": mid, "path": "ck", "seq_id": 1},
        "/save_weights_for_sampler": {"model_id": mid, "path": "sk", "seq_id": 1},
        "/load_weights": {"model_id": mid, "seq_id": 1, "path": path, "optimizer": False},
        "/create_sampling_session": {
            "session_id": sid,
            "sampling_session_seq_id": 900,
            "base_model": "tinker-sr/tiny",
        },
        "/asample": {
            "num_samples": 1,
            "prompt": prompt,
            "sampling_params": {"max_tokens": 2, "temperature": 1.0, "top_p": 1.0},
            "sampling_session_id": ids.get("sampler_id", "x:sample:0"),
            "seq_id": 0,
        },
        "/retrieve_future": {"request_id": "req-x"},
        "/weights_info": {"tinker_path": path},
        "/copy_weights": {"source_path": path},
        "/telemetry": {"events": []},
        "/client/config": {"sdk_version": "0.38.0"},
    }


class Adversary:
    """Reproducible hostile requests: the same seed gives the same sequence."""

    def __init__(self, seed: int, routes: list[tuple[str, str]], ids: Mapping[str, Any]) -> None:
        self.rng = random.Random(seed)
        self.routes = routes
        self.ids = dict(ids)
        self.valid = _valid_bodies(ids)

    def requests(self, n: int) -> list[AttackRequest]:
        return [self.request(self.routes[i % len(self.routes)]) for i in range(n)]

    def request(self, route: tuple[str, str]) -> AttackRequest:
        method, template = route
        path = self._fill(template)
        if method in ("GET", "DELETE"):
            return AttackRequest(method, path + self._query(), None, what="query")
        tail = template.removeprefix("/api/v1")
        kind = self.rng.randrange(6)
        if tail == "/forward_backward" or kind == 0:
            blob = self.rng.randbytes(self.rng.choice([0, 1, 7, 64, 600]))
            ctype = self.rng.choice(["application/x-protobuf", "application/json", "text/plain"])
            return AttackRequest(method, path, blob, ctype, "bytes")
        if kind == 1:
            return AttackRequest(method, path, self._deep(), what="deep")
        if kind == 2 or tail not in self.valid:
            return AttackRequest(method, path, _dumps(self._json(3)), what="random json")
        body = json.loads(json.dumps(self.valid[tail]))
        self._mutate(body)
        return AttackRequest(method, path, _dumps(body), what="mutated")

    # ---- pieces ------------------------------------------------------------------------
    def _fill(self, template: str) -> str:
        path = template
        while "{" in path:
            start, end = path.index("{"), path.index("}")
            name = path[start + 1 : end].split(":")[0]
            value = self.ids.get(name) if self.rng.random() < 0.5 else None
            if value is None:
                value = self.rng.choice(_ROUTE_PARAMS + ["weights", "sampler_weights"])
            path = path[:start] + _quote(str(value)) + path[end + 1 :]
        return path

    def _query(self) -> str:
        parts = []
        for name in self.rng.sample(_QUERY_NAMES, self.rng.choice([1, 2, 3])):
            parts.append(f"{name}={_quote(self.rng.choice(_QUERY_VALUES))}")
        return "?" + "&".join(parts)

    def _deep(self) -> bytes:
        depth = self.rng.choice([65, 500, 2000, 100_000])
        opener = self.rng.choice([b"[", b'{"a":'])
        return opener * depth

    def _scalar(self) -> Any:
        pick = self.rng.randrange(4)
        if pick == 0:
            return self.rng.choice(_EVIL_STRINGS)
        if pick == 1:
            return self.rng.choice(_EVIL_NUMBERS)
        return self.rng.choice([None, [], {}, [1, "a"], {"": None}])

    def _json(self, depth: int) -> Any:
        if depth == 0 or self.rng.random() < 0.4:
            return self._scalar()
        if self.rng.random() < 0.5:
            return [self._json(depth - 1) for _ in range(self.rng.randrange(4))]
        return {self.rng.choice(_EVIL_STRINGS): self._json(depth - 1) for _ in range(3)}

    def _mutate(self, body: dict[str, Any]) -> None:
        """Break one field somewhere in ``body`` (or add an unknown one)."""
        node: Any = body
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = self.rng.choice(keys)
            child = node[key]
            if isinstance(child, dict | list) and child and self.rng.random() < 0.6:
                node = child
                continue
            if self.rng.random() < 0.1 and isinstance(node, dict):
                node.pop(key)
            else:
                node[key] = self._json(2)
            return
        if isinstance(node, dict):
            node[self.rng.choice(_EVIL_STRINGS)] = self._scalar()


def send(http: Any, req: AttackRequest) -> Any:
    """Send ``req`` with an ``httpx.Client`` (base_url and API key already set)."""
    headers = {"Content-Type": req.content_type} if req.body is not None else {}
    return http.request(req.method, req.path, content=req.body, headers=headers)


def _error_problem(resp: Any, ctype: str) -> str | None:
    """An error answer without its message: the Tinker API's ``{"detail": ...}``, or under
    ``/oai/`` and ``/anthropic/`` OpenAI's and Anthropic's ``{..., "error": {"message": ...}}``."""
    body = resp.json() if ctype.startswith("application/json") else None
    if resp.request.url.path.startswith(("/oai/", "/anthropic/")):
        err = body.get("error") if isinstance(body, dict) else None
        detail = err.get("message") if isinstance(err, dict) else None
    else:
        detail = body.get("detail") if isinstance(body, dict) else None
    return None if isinstance(detail, str) and detail else f"no JSON detail: {resp.text[:200]}"


def judge(http: Any, resp: Any, *, future_timeout_s: float = 120.0) -> str | None:
    """What is wrong with the server's answer, or None. Wrong: a status >= 500, an error
    without its JSON message (`_error_problem`), or an accepted request whose future fails as
    a "server" error or is not done within ``future_timeout_s`` (a hang)."""
    import time

    if resp.status_code >= 500:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    ctype = resp.headers.get("content-type", "")
    if resp.status_code >= 400:
        return _error_problem(resp, ctype)
    if not ctype.startswith("application/json"):
        return None
    body = resp.json()
    if not (isinstance(body, dict) and "request_id" in body and len(body) <= 4):
        return None
    deadline = time.monotonic() + future_timeout_s
    while time.monotonic() < deadline:
        got = http.post("/api/v1/retrieve_future", json={"request_id": body["request_id"]})
        if got.status_code >= 500:
            return f"retrieve_future HTTP {got.status_code}: {got.text[:200]}"
        if got.status_code != 200 or not got.headers["content-type"].startswith("application/json"):
            return None
        result = got.json()
        if result.get("type") == "try_again":
            continue
        if result.get("category") == "server":
            return f"server-category failure: {result.get('error', '')[:200]}"
        return None
    return f"future {body['request_id']} not done after {future_timeout_s} s"


def _dumps(obj: Any) -> bytes:
    # NaN/Infinity as the bare tokens Python writes, lone surrogates as \\ud800 escapes.
    return json.dumps(obj).encode()


def _quote(value: str) -> str:
    from urllib.parse import quote

    return quote(value.encode("utf-8", "surrogatepass"), safe="")
