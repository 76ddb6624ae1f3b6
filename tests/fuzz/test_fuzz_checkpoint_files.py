"""Fuzz a saved checkpoint's file on disk, as bit rot, a bad copy or a hand edit leave it:
bytes flipped, the file cut, the header's dtype, shape, offsets or metadata rewritten, NaN
written into the data. Loading it (`create_training_client_from_state_with_optimizer`, the
resume path of every long run) either gives a client with finite weights, or a user error
naming the checkpoint; never "internal error", never the store's path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinker_sr
from tests.fuzz.conftest import FUZZ, scaled
from tests.fuzz.test_fuzz_model_files import DTYPES, SPECIAL, _join, _split
from tinker_sr.backend.local import LocalBackend

META_VALUES = st.one_of(
    st.none(), st.integers(-5, 10**12), st.text(max_size=12), st.sampled_from(["", "-1", "1e9"])
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Path, bytes]]:
    """An embedded service with one saved training state: (service, path, file, bytes)."""
    store = tmp_path_factory.mktemp("fuzz_ckpt") / "store"
    backend = LocalBackend(store)
    service = tinker_sr.ServiceClient(backend=backend)
    trainer = service.create_lora_training_client(base_model="tinker-sr/tiny", rank=2).result()
    path = trainer.save_state("fuzzed").result().path
    (file,) = store.glob("checkpoints/**/fuzzed.safetensors")
    yield service, path, file, file.read_bytes()
    service.close().result()
    backend.close()


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("dtype"), st.integers(0, 100), st.sampled_from(DTYPES)),
    st.tuples(st.just("shape"), st.integers(0, 100), st.lists(st.integers(-1, 300), max_size=3)),
    st.tuples(st.just("data"), st.integers(0, 10**6), st.sampled_from(SPECIAL)),
    st.tuples(st.just("meta"), st.integers(0, 100), META_VALUES),
    st.tuples(st.just("drop"), st.integers(0, 100), st.just(0)),
)


def _mutate(raw: bytes, kind: str, where: int, what: Any) -> bytes:
    if kind == "flip":
        at = where % len(raw)
        return raw[:at] + bytes([raw[at] ^ what]) + raw[at + 1 :]
    if kind == "cut":
        return raw[: where % len(raw)]
    header, data = _split(raw)
    meta = header.setdefault("__metadata__", {})
    names = sorted(k for k in header if k != "__metadata__")
    name = names[where % len(names)]
    if kind == "dtype":
        header[name]["dtype"] = what
    elif kind == "shape":
        header[name]["shape"] = what
    elif kind == "data":
        at = header[name]["data_offsets"][0]
        data = data[:at] + what + data[at + len(what) :]
    elif kind == "meta":  # a metadata key's value: any JSON (safetensors wants strings)
        key = sorted(meta)[where % len(meta)] if meta else "base_model"
        meta[key] = what
    else:  # drop a metadata key
        if meta:
            del meta[sorted(meta)[where % len(meta)]]
    return _join(header, data)


@settings(FUZZ, max_examples=scaled(60))
@given(mutation=MUTATIONS)
def test_a_damaged_checkpoint_resumes_finite_or_is_refused_by_name(
    saved: tuple[Any, str, Path, bytes], mutation: tuple
) -> None:
    service, path, file, original = saved
    file.write_bytes(_mutate(original, *mutation))
    try:
        client = service.create_training_client_from_state_with_optimizer(path).result()
    except tinker_sr.RequestFailedError as e:
        message = str(e)
        assert "internal error" not in message, (mutation, message)
        assert str(file.parent) not in message, (mutation, message)
        return
    finally:
        file.write_bytes(original)
    weights = client.holder.backend.models.trainer(client.model_id).model.state_dict()
    for name, tensor in weights.items():
        if tensor.is_floating_point():
            assert bool(tensor.isfinite().all()), (mutation, name)
