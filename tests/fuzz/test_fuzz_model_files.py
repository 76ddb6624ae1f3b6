"""Fuzz a model directory's weights file as the engine loads it: bytes flipped in the header or
the data, the file cut short, the header rewritten with another dtype, shape or offsets, a
tensor re-saved with another shape of any rank. Loading
either gives a model whose every weight is finite and was stored as floats, or `EngineUserError` naming the file or
tensor; nothing else escapes (no TypeError, no crash, no NaN weight trained on silently)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ, scaled

pytest.importorskip("transformers")
import torch  # noqa: E402

from tinker_sr.engine.hf import load_model_dir  # noqa: E402
from tinker_sr.engine.hybrid import UNUSED_PREFIXES  # noqa: E402
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.user_errors import EngineUserError  # noqa: E402

SPECIAL = [struct.pack("<f", v) for v in (float("nan"), float("inf"), float("-inf"), 3e38)]
DTYPES = ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8",
          "BOOL", "F4", "X9"]  # fmt: skip


@pytest.fixture(scope="module", params=["qwen3", "qwen3_vl_moe", "gpt_oss"])
def base(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A dense model, a vision-language checkpoint whose experts are stored fused (3-D), and
    gpt-oss (fused experts with interleaved gate/up columns, their 2-D biases, sinks)."""
    root = tmp_path_factory.mktemp("fuzz_model") / request.param
    return make_tiny_hf_model_dir(root, request.param, n_layers=1)


def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("dtype"), st.integers(0, 100), st.sampled_from(DTYPES)),
    st.tuples(st.just("shape"), st.integers(0, 100), st.lists(st.integers(-1, 300), max_size=3)),
    st.tuples(st.just("offsets"), st.integers(0, 100), st.integers(-64, 64)),
    st.tuples(st.just("resave"), st.integers(0, 100), st.lists(st.integers(0, 70), max_size=4)),
    st.tuples(
        st.just("data"),
        st.integers(0, 10**6),
        st.one_of(st.binary(min_size=1, max_size=8), st.sampled_from(SPECIAL)),
    ),
)


def _mutate(raw: bytes, kind: str, where: int, what: object) -> bytes:
    header, data = _split(raw)
    names = sorted(k for k in header if k != "__metadata__")
    name = names[where % len(names)]
    if kind == "flip":  # anywhere in the file, header included
        at = where % len(raw)
        return raw[:at] + bytes([raw[at] ^ int(what)]) + raw[at + 1 :]  # type: ignore[call-overload]
    if kind == "cut":
        return raw[: where % len(raw)]
    if kind == "resave":  # a valid file whose tensor has another shape, any rank
        from safetensors.torch import load, save

        tensors = load(raw)
        tensors[name] = torch.zeros(what)
        return save(tensors, header.get("__metadata__"))
    if kind == "dtype":
        header[name]["dtype"] = what
    elif kind == "shape":
        header[name]["shape"] = what
    elif kind == "offsets":
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [start, end + int(what)]  # type: ignore[call-overload]
    else:  # overwrite data bytes: any bit pattern, NaN and infinity included
        at = where % len(data) & ~3  # float32 data: a float's first byte
        patch = bytes(what)  # type: ignore[call-overload]
        data = data[:at] + patch[: len(data) - at] + data[at + len(patch) :]
    return _join(header, data)


@settings(FUZZ, max_examples=scaled(80))
@given(mutation=MUTATIONS)
def test_a_damaged_weights_file_loads_finite_or_is_refused_by_name(
    base: Path, tmp_path_factory: pytest.TempPathFactory, mutation: tuple
) -> None:
    root = tmp_path_factory.mktemp("m") / "m"
    shutil.copytree(base, root)
    weights = root / "model.safetensors"
    weights.write_bytes(_mutate(weights.read_bytes(), *mutation))
    try:
        model = load_model_dir(root)
    except EngineUserError as e:
        assert str(root) in str(e) or "tensor " in str(e), e
        return
    # What the engine reads: not what it skips by name (a vision-language checkpoint's vision
    # tower: text only, docs/models.md), whose damage a text model never meets.
    header = _split(weights.read_bytes())[0]
    read = [k for k in header if k != "__metadata__" and not k.startswith(UNUSED_PREFIXES)]
    stored = {header[k]["dtype"] for k in read}
    assert stored <= {"F64", "F32", "F16", "BF16"}, f"{mutation}: loaded {stored} as weights"
    for name, tensor in model.state_dict().items():
        assert torch.isfinite(tensor).all(), f"{mutation}: {name} loaded non-finite"
