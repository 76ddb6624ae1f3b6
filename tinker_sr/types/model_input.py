"""Model inputs: an ordered list of chunks (text tokens, images, DMel audio)."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Literal, TypeAlias

from pydantic import BeforeValidator, Discriminator, PlainSerializer, Tag

from ._base import StrictBase

__all__ = [
    "EncodedTextChunk",
    "ImageChunk",
    "ImageAssetPointerChunk",
    "DmelChunk",
    "ModelInputChunk",
    "ModelInput",
]


def _b64_to_bytes(value: object) -> object:
    # JSON carries bytes as base64 text; accept both forms on input.
    return base64.b64decode(value) if isinstance(value, str) else value


def _bytes_to_b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


# Bytes on the model, base64 text when dumped (a base64 string is accepted on input).
Base64Bytes: TypeAlias = Annotated[
    bytes, BeforeValidator(_b64_to_bytes), PlainSerializer(_bytes_to_b64)
]


class EncodedTextChunk(StrictBase):
    tokens: Sequence[int]
    """Token ids."""

    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class ImageChunk(StrictBase):
    data: Base64Bytes
    """Encoded image bytes (a base64 string is accepted and decoded)."""

    format: Literal["png", "jpeg"]

    expected_tokens: int | None = None
    """Advisory token count; the server recomputes it and may fail fast on a mismatch."""

    type: Literal["image"] = "image"

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise ValueError(
                "ImageChunk expected_tokens needs to be set in order to compute the length"
            )
        return self.expected_tokens


class ImageAssetPointerChunk(StrictBase):
    format: Literal["png", "jpeg"]

    location: str
    """Path or URL of the image."""

    expected_tokens: int | None = None
    """Advisory token count; the server recomputes it and may fail fast on a mismatch."""

    type: Literal["image_asset_pointer"] = "image_asset_pointer"

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise ValueError(
                "ImageAssetPointerChunk expected_tokens needs to be set in order to compute "
                "the length"
            )
        return self.expected_tokens


_CONSTANT_TENSOR_MARKER = 254
_MAX_DTYPE_BYTE = 7


def _read_varint(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= len(data):
            raise ValueError("Truncated TensorContainer header")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7
        if shift > 63:
            raise ValueError("TensorContainer varint is too long")


def tensor_container_shape(data: bytes) -> tuple[int, ...]:
    """Shape from a TensorContainer header: [254 if constant] dtype-byte ndim dims (varints)."""
    if not data:
        raise ValueError("TensorContainer bytes are empty")
    offset = 1 if data[0] == _CONSTANT_TENSOR_MARKER else 0
    if offset >= len(data):
        raise ValueError("Truncated TensorContainer header")
    if data[offset] > _MAX_DTYPE_BYTE:
        raise ValueError(f"Unknown TensorContainer dtype byte: {data[offset]}")
    ndim, offset = _read_varint(data, offset + 1)
    shape = []
    for _ in range(ndim):
        dim, offset = _read_varint(data, offset)
        shape.append(dim)
    return tuple(shape)


class DmelChunk(StrictBase):
    dmel: Base64Bytes
    """Serialized TensorContainer holding the DMel token tensor (base64 string accepted)."""

    type: Literal["dmel"] = "dmel"

    @property
    def length(self) -> int:
        shape = tensor_container_shape(self.dmel)
        if not shape:
            raise ValueError("TensorContainer tensor has no dimension 0")
        return shape[0]


def _chunk_tag(value: object) -> str | None:
    # The official SDK's union is not strictly discriminated: a chunk dict without "type"
    # validates as text. Keep that leniency, dispatch on "type" otherwise.
    if isinstance(value, dict):
        return value.get("type", "encoded_text")
    return getattr(value, "type", None)


ModelInputChunk: TypeAlias = Annotated[
    Annotated[EncodedTextChunk, Tag("encoded_text")]
    | Annotated[ImageAssetPointerChunk, Tag("image_asset_pointer")]
    | Annotated[ImageChunk, Tag("image")]
    | Annotated[DmelChunk, Tag("dmel")],
    Discriminator(_chunk_tag),
]


class ModelInput(StrictBase):
    chunks: list[ModelInputChunk]
    """Input chunks, in order."""

    @classmethod
    def from_ints(cls, tokens: list[int]) -> ModelInput:
        """A ModelInput holding one text chunk with ``tokens``."""
        return cls(chunks=[EncodedTextChunk(tokens=tokens)])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        """All tokens as one list; only valid when every chunk is an EncodedTextChunk."""
        if not all(isinstance(chunk, EncodedTextChunk) for chunk in self.chunks):
            raise ValueError(
                "to_ints only supported for ModelInput with EncodedTextChunks, got "
                f"{[type(chunk) for chunk in self.chunks]}"
            )
        return [token for chunk in self.chunks for token in chunk.tokens]  # type: ignore[union-attr]

    @property
    def length(self) -> int:
        """Total number of context positions this input occupies."""
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: ModelInputChunk) -> ModelInput:
        """A new ModelInput with ``chunk`` added at the end."""
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        """A new ModelInput with one more token (as its own text chunk)."""
        return self.append(EncodedTextChunk(tokens=[token]))
