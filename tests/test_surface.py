"""``import tinker_sr as tinker`` must expose the official SDK 0.38's public surface.

Compares, against the installed SDK (a dev dependency):

* every name in ``tinker.__all__`` (and ``tinker.lib.public_interfaces.__all__``): present
  in tinker_sr with the same kind (module / function / dataclass / pydantic model / enum /
  class / type alias / value);
* every public method of the clients and `APIFuture`: present, with the same parameter
  names, kinds and defaults (``inspect.signature``); constructors of the user-built clients;
* the `auth` helpers, `LossHandle`'s fields, `RequestOptions`' keys, exception hierarchy.

Differences are either listed below with a reason, or fail the test. Entries that no longer
differ also fail the test, so the lists stay true.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import typing
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import typing_extensions

import tinker_sr

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    sdk = pytest.importorskip("tinker")
    import tinker.lib.public_interfaces as sdk_public

import tinker_sr.lib.public_interfaces as our_public

# ---- deliberate differences (by design; keep the reason current) ----------------------------

DELIBERATE: dict[str, str] = {
    # The SDK exposes ``holder`` as a deprecated property over its InternalClientHolder; ours
    # is a plain instance attribute (our ClientSession), so ``client.holder`` still works.
    "ServiceClient.holder": "instance attribute, not a class-level property",
    # The other way round: the SDK's AdminClient sets ``self.holder``; ours builds it on first
    # access, so constructing an AdminClient (whose methods all raise) opens nothing.
    "AdminClient.holder": "lazy property, not an instance attribute",
    # SDK internals with no tinker_sr counterpart: a factory over InternalClientHolder (we
    # create samplers through ServiceClient/TrainingClient) and the queue-state observer
    # callback (tinker_sr has no server-side queue that throttles sampling).
    "SamplingClient.create": "internal factory over the SDK's InternalClientHolder",
    "SamplingClient.on_queue_state_change": "SDK queue-state callback; no such queue here",
    # ``close(status)`` has no default in the SDK; ours defaults to "success", a superset:
    # every SDK call still works, and ``close()`` alone finishes the session successfully.
    "ServiceClient.close": "ours defaults status='success' (superset of the SDK's)",
    # tinker_sr addition (documented on the method): one checkpoint's metadata.
    "RestClient.get_checkpoint_by_tinker_path": "tinker_sr extra",
    # tinker_sr addition: which path stable_reinforce took (native or lowered; issue 13).
    "ServiceClient.stable_reinforce_path": "tinker_sr extra",
}

# Extra parameters of ours, ignored when comparing a signature.
DELIBERATE_EXTRA_PARAMS: dict[str, set[str]] = {
    # ``backend=`` picks the embedded engine, a remote server or a Backend instance.
    # ``stable_reinforce_lowering=`` forces or forbids lowering stable_reinforce to
    # cross_entropy on services without it (docs/stable_reinforce.md).
    "ServiceClient.__init__": {"backend", "stable_reinforce_lowering"},
}

# ---- known gaps (NOT deliberate): fix, then delete the entry ----------------------------------

KNOWN_GAPS: dict[str, str] = {}

# Methods whose signature matches the SDK but which tinker_sr does not support would be listed
# here, each raising `NotImplementedError` naming the reason. There are none: the last two
# (save_weights_external, get_external_weights_urls) work since the fifteenth session
# (tests/test_external_weights.py).
UNSUPPORTED_METHODS: dict[str, str] = {}

CLASSES = [
    "ServiceClient",
    "TrainingClient",
    "SamplingClient",
    "RestClient",
    "AdminClient",
    "APIFuture",
]
CONSTRUCTED_BY_USERS = {"ServiceClient", "RestClient", "AdminClient"}


# ---- helpers --------------------------------------------------------------------------------


def kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        if typing_extensions.is_typeddict(obj):
            return "TypedDict"
        if issubclass(obj, BaseException):
            return "exception"
        if issubclass(obj, enum.Enum):
            return "enum"
        if issubclass(obj, pydantic.BaseModel):
            return "pydantic model"
        if dataclasses.is_dataclass(obj):
            return "dataclass"
        return "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "function"
    origin = typing.get_origin(obj)
    if origin is not None:
        return f"type alias of {getattr(origin, '__qualname__', origin)!s}"
    return f"value of type {type(obj).__name__}"


def public_members(cls: type) -> dict[str, Any]:
    """Public methods and properties, inherited ones included (``object``'s excluded)."""
    out: dict[str, Any] = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if isinstance(attr, property) or callable(attr):
            out[name] = attr
    return out


def param_list(
    fn: Any, drop: frozenset[str] | set[str] = frozenset()
) -> list[tuple[str, str, Any]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values() if p.name not in drop]


def signature_differences() -> Iterator[tuple[str, str]]:
    for cname in CLASSES:
        ours_cls, theirs_cls = getattr(tinker_sr, cname), getattr(sdk, cname)
        ours, theirs = public_members(ours_cls), public_members(theirs_cls)
        if cname in CONSTRUCTED_BY_USERS:
            ours["__init__"], theirs["__init__"] = ours_cls.__init__, theirs_cls.__init__
        for name in sorted(set(ours) | set(theirs)):
            key = f"{cname}.{name}"
            if name not in ours:
                yield (
                    key,
                    f"missing (SDK: {name}{inspect.signature(theirs[name]) if callable(theirs[name]) else ' property'})",
                )
                continue
            if name not in theirs:
                yield key, "extra (not in the SDK)"
                continue
            a, b = theirs[name], ours[name]
            if isinstance(a, property) or isinstance(b, property):
                if isinstance(a, property) != isinstance(b, property):
                    yield key, "property in one, method in the other"
                continue
            drop = DELIBERATE_EXTRA_PARAMS.get(key, set())
            if param_list(a) != param_list(b, drop):
                yield key, f"signature: SDK {inspect.signature(a)} vs ours {inspect.signature(b)}"
            # Unwrap: the SDK's @deprecated wrapper hides ``async def`` on Python 3.11.
            if inspect.iscoroutinefunction(inspect.unwrap(a)) != inspect.iscoroutinefunction(
                inspect.unwrap(b)
            ):
                yield key, "async in one, sync in the other"


# ---- tests ----------------------------------------------------------------------------------


def test_top_level_names_and_kinds() -> None:
    problems = []
    for name in sdk.__all__:
        if not hasattr(tinker_sr, name):
            problems.append(f"tinker_sr.{name}: missing")
        elif name not in tinker_sr.__all__:
            problems.append(f"tinker_sr.{name}: not in __all__")
        elif kind(getattr(tinker_sr, name)) != kind(getattr(sdk, name)):
            ours, theirs = kind(getattr(tinker_sr, name)), kind(getattr(sdk, name))
            problems.append(f"tinker_sr.{name}: {ours}, SDK: {theirs}")
    extra = sorted(set(tinker_sr.__all__) - set(sdk.__all__))
    problems += [f"tinker_sr.{name}: extra in __all__" for name in extra]
    assert not problems, "\n".join(problems)


def field_shape(cls: Any) -> dict[str, str] | None:
    """Field name -> "required" or the default's repr (a model default by its class name)."""
    if inspect.isclass(cls) and issubclass(cls, pydantic.BaseModel):
        return {
            name: "required"
            if f.is_required()
            else type(f.default).__name__
            if isinstance(f.default, pydantic.BaseModel)
            else repr(f.default)
            for name, f in cls.model_fields.items()
        }
    if dataclasses.is_dataclass(cls):
        return {
            f.name: "required"
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            else "default"
            for f in dataclasses.fields(cls)
        }
    return None


def test_types_module_names_kinds_and_fields() -> None:
    """Every public name of ``tinker.types`` exists in ``tinker_sr.types`` with the same kind,
    and every model/dataclass has the same fields, required fields and defaults."""
    names = [
        n
        for n in dir(sdk.types)
        if not n.startswith("_")
        and n != "annotations"  # ``from __future__ import annotations`` leaking out
        and not inspect.ismodule(getattr(sdk.types, n))
    ]
    assert len(names) > 150
    problems = []
    for name in names:
        theirs, ours = getattr(sdk.types, name), getattr(tinker_sr.types, name, None)
        if ours is None or name not in tinker_sr.types.__all__:
            problems.append(f"tinker_sr.types.{name}: missing")
        elif kind(ours) != kind(theirs):
            problems.append(f"tinker_sr.types.{name}: {kind(ours)}, SDK: {kind(theirs)}")
        elif field_shape(ours) != field_shape(theirs):
            problems.append(f"{name} fields: SDK {field_shape(theirs)} vs ours {field_shape(ours)}")
    assert not problems, "\n".join(problems)


def test_public_interfaces_module() -> None:
    problems = []
    for name in sdk_public.__all__:
        if not hasattr(our_public, name) or name not in our_public.__all__:
            problems.append(f"tinker_sr.lib.public_interfaces.{name}: missing")
        elif kind(getattr(our_public, name)) != kind(getattr(sdk_public, name)):
            problems.append(f"tinker_sr.lib.public_interfaces.{name}: kind differs")
    assert not problems, "\n".join(problems)
    for name in our_public.__all__:
        if hasattr(tinker_sr, name):
            assert getattr(our_public, name) is getattr(tinker_sr, name), name


def test_client_method_signatures() -> None:
    found = dict(signature_differences())
    allowed = DELIBERATE.keys() | KNOWN_GAPS.keys()
    unexpected = {k: v for k, v in found.items() if k not in allowed}
    assert not unexpected, "differences from the SDK 0.38:\n" + "\n".join(
        f"  {k}: {v}" for k, v in sorted(unexpected.items())
    )
    stale = sorted(allowed - found.keys())
    assert not stale, f"listed as differences but now match the SDK; delete them: {stale}"
    assert not DELIBERATE.keys() & KNOWN_GAPS.keys()


def test_auth_helpers_match() -> None:
    assert sorted(tinker_sr.auth.__all__) == sorted(sdk.auth.__all__)
    for name in sdk.auth.__all__:
        assert param_list(getattr(tinker_sr.auth, name)) == param_list(getattr(sdk.auth, name))


def test_loss_handle_and_request_options_shape() -> None:
    def fields(cls: Any) -> list[tuple[str, Any]]:
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert fields(tinker_sr.LossHandle) == fields(sdk.LossHandle)
    assert tinker_sr.LossHandle.__dataclass_params__.frozen
    for prop in ("key", "input_names"):
        assert isinstance(inspect.getattr_static(tinker_sr.LossHandle, prop), property)
    assert typing.get_origin(tinker_sr.PerDatumLossFn) is typing.get_origin(sdk.PerDatumLossFn)
    assert tinker_sr.Timeout is sdk.Timeout  # both are httpx.Timeout
    assert (
        tinker_sr.RequestOptions.__annotations__.keys() == sdk.RequestOptions.__annotations__.keys()
    )
    assert tinker_sr.RequestOptions.__total__ is sdk.RequestOptions.__total__ is False


def test_exception_and_warning_hierarchy() -> None:
    names = [n for n in sdk.__all__ if kind(getattr(sdk, n)) == "exception"]
    for a in names:
        for b in names:
            theirs = issubclass(getattr(sdk, a), getattr(sdk, b))
            assert issubclass(getattr(tinker_sr, a), getattr(tinker_sr, b)) == theirs, (a, b)
        builtin_bases = [c for c in getattr(sdk, a).__mro__ if c.__module__ == "builtins"]
        assert [c for c in getattr(tinker_sr, a).__mro__ if c.__module__ == "builtins"] == (
            builtin_bases
        ), a


# ---- behaviour of the added names -----------------------------------------------------------


def test_admin_client_audit_log_says_it_is_unsupported() -> None:
    admin = tinker_sr.AdminClient()  # constructing it opens nothing
    assert admin._holder is None
    assert admin.get_telemetry() is None
    with pytest.raises(NotImplementedError, match=r"get_audit_log\(\).*keeps no audit log"):
        admin.get_audit_log()
    with pytest.raises(NotImplementedError, match="get_audit_log_async"):
        import asyncio

        asyncio.run(admin.get_audit_log_async())
    with pytest.raises(ValueError, match="either a holder or base_url"):
        tinker_sr.AdminClient(object(), base_url="http://x")  # type: ignore[arg-type]


def test_auth_on_the_embedded_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    monkeypatch.delenv("TINKER_SR_BACKEND", raising=False)
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    assert tinker_sr.auth.tinker_has_credentials() is True  # type: ignore[attr-defined]  # no credential needed
    assert tinker_sr.auth.get_tinker_token() is None
    tinker_sr.auth.raise_if_tinker_not_accessible()  # always accessible
    monkeypatch.setenv("TINKER_API_KEY", "tml-abc")
    assert tinker_sr.auth.get_tinker_token() == "tml-abc"


def test_auth_against_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests._server import free_port

    monkeypatch.delenv("TINKER_SR_BACKEND", raising=False)
    monkeypatch.setenv("TINKER_BASE_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    assert tinker_sr.auth.tinker_has_credentials() is False
    with pytest.raises(tinker_sr.TinkerError, match="API key"):
        tinker_sr.auth.raise_if_tinker_not_accessible()
    monkeypatch.setenv("TINKER_API_KEY", "not-a-key")
    assert tinker_sr.auth.tinker_has_credentials() is False
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    assert tinker_sr.auth.tinker_has_credentials() is True
    with pytest.raises(tinker_sr.APIConnectionError):  # one request, no retries
        tinker_sr.auth.raise_if_tinker_not_accessible()
    monkeypatch.setenv("TINKER_SR_BACKEND", "local")  # forces the embedded engine
    tinker_sr.auth.raise_if_tinker_not_accessible()


def test_a_remote_backend_without_a_server_says_so_before_asking_for_a_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``TINKER_SR_BACKEND=remote`` with no URL and no key asked for an API key; the missing
    server is the first thing to fix."""
    for env in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TINKER_SR_BACKEND", "remote")
    with pytest.raises(tinker_sr.TinkerError, match="backend='remote' needs a server"):
        tinker_sr.ServiceClient()
    monkeypatch.delenv("TINKER_SR_BACKEND")
    with pytest.raises(tinker_sr.TinkerError, match="backend='remote' needs a server"):
        tinker_sr.ServiceClient(backend="remote")


def test_get_telemetry_is_none_everywhere(tmp_path: Any) -> None:
    from tinker_sr.backend.local import LocalBackend

    backend = LocalBackend(tmp_path / "store")
    service = tinker_sr.ServiceClient(backend=backend)
    try:
        training = service.create_lora_training_client("tinker-sr/tiny", rank=2).result()
        sampler = service.create_sampling_client(base_model="tinker-sr/tiny").result()
        for client in (service, training, sampler, tinker_sr.RestClient(service.holder)):
            assert client.get_telemetry() is None
    finally:
        service.close().result()
        backend.close()


def test_every_sdk_method_is_supported() -> None:
    assert UNSUPPORTED_METHODS == {}


def test_service_client_needs_no_key_for_a_server_on_this_machine(
    monkeypatch: pytest.MonkeyPatch, remote_server: Any, tmp_path: Path
) -> None:
    from tests._server import free_port
    from tinker_sr.backend.transport import is_loopback_url
    from tinker_sr.clients.holder import LOCAL_API_KEY

    for env in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_SR_BACKEND"):
        monkeypatch.delenv(env, raising=False)
    port = free_port()  # nothing listens: construction makes no request
    for host in ("127.0.0.1", "localhost", "LOCALHOST", "[::1]", "127.0.0.2"):
        url = f"http://{host}:{port}"
        assert is_loopback_url(url)
        client = tinker_sr.ServiceClient(base_url=url)
        assert client.holder.api_key == LOCAL_API_KEY == "tml-local"
        client.close().result()
        rest = tinker_sr.RestClient(base_url=url)  # the same default for RestClient
        assert rest.holder.backend._api_key == "tml-local"
    # $TINKER_BASE_URL counts too; an explicit or configured key still wins.
    monkeypatch.setenv("TINKER_BASE_URL", f"http://localhost:{port}")
    assert tinker_sr.ServiceClient().holder.api_key == "tml-local"
    assert tinker_sr.ServiceClient(api_key="tml-mine").holder.api_key == "tml-mine"
    monkeypatch.setenv("TINKER_API_KEY", "tml-env")
    assert tinker_sr.ServiceClient().holder.api_key == "tml-env"
    with pytest.raises(tinker_sr.TinkerError, match="must start with 'tml-'"):
        tinker_sr.ServiceClient(api_key="not-a-key")  # the official rule for given keys
    monkeypatch.delenv("TINKER_API_KEY")
    monkeypatch.delenv("TINKER_BASE_URL")

    # Anywhere else the official rule holds: a key is required and must start with tml-.
    for url in ("http://example.com", "http://10.0.0.1:8000", "http://localhost.example.com"):
        assert not is_loopback_url(url)
        with pytest.raises(tinker_sr.TinkerError, match="No API key"):
            tinker_sr.ServiceClient(base_url=url)
    with pytest.raises(tinker_sr.TinkerError, match="must start with 'tml-'"):
        tinker_sr.ServiceClient(base_url="http://example.com", api_key="sk-123")
    # The embedded engine never needs one.
    assert tinker_sr.ServiceClient(backend="local").holder.api_key is None

    # The key `tinker auth login` stored comes after $TINKER_API_KEY, for remote servers only.
    stored = tmp_path / "credentials.json"
    monkeypatch.setattr(tinker_sr.auth, "credentials_path", lambda: stored)
    record = {"type": "manual", "key": "tml-stored", "name": "cli"}
    stored.write_text(json.dumps({"version": 1, "default": "k1", "keys": {"k1": record}}))
    assert tinker_sr.ServiceClient(base_url="http://example.com").holder.api_key == "tml-stored"
    assert tinker_sr.auth.tinker_has_credentials() is True
    url = remote_server.base_url
    assert tinker_sr.ServiceClient(base_url=url).holder.api_key == "tml-local"  # not sent here
    monkeypatch.setenv("TINKER_API_KEY", "tml-env")
    assert tinker_sr.ServiceClient(base_url="http://example.com").holder.api_key == "tml-env"
    monkeypatch.delenv("TINKER_API_KEY")
    monkeypatch.setenv("TINKER_CREDENTIAL_CMD", "echo x")  # the SDK prefers the command
    with pytest.raises(tinker_sr.TinkerError, match="No API key"):
        tinker_sr.ServiceClient(base_url="http://example.com")
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD")
    stored.write_text("{not json")
    with pytest.raises(tinker_sr.TinkerError, match="credentials.json: not a readable"):
        tinker_sr.ServiceClient(base_url="http://example.com")
    stored.unlink()

    # End to end: a real local server, no key configured anywhere.
    service = tinker_sr.ServiceClient(base_url=remote_server.base_url)
    try:
        training = service.create_lora_training_client("tinker-sr/tiny", rank=2).result()
        assert training.model_id.endswith(":train:0")
    finally:
        service.close().result()
