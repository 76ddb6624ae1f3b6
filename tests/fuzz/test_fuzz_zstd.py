"""`wire.compression.zstd_decompress` on generated zstd bodies: every frame of a body is read
(RFC 8878: a body is one or more frames), a body cut anywhere but at a frame boundary is refused,
the size limit holds, and corrupted bodies get the caller's `WireError`, never anything else."""

from __future__ import annotations

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ
from tinker_sr.wire import compression
from tinker_sr.wire.errors import BodyTooLargeError, WireError

pieces = st.lists(st.binary(max_size=3000) | st.builds(lambda n: b"r" * n, st.integers(0, 9000)),
                  min_size=1, max_size=4)  # fmt: skip


def _frames(parts: list[bytes], checksum: bool, level: int) -> tuple[bytes, set[int]]:
    """One frame per part; the body and the offsets where a frame ends."""
    body, ends = b"", set()
    for part in parts:
        body += zstandard.ZstdCompressor(level=level, write_checksum=checksum).compress(part)
        ends.add(len(body))
    return body, ends


@FUZZ
@given(parts=pieces, checksum=st.booleans(), level=st.integers(1, 9), cut=st.integers(0, 10**6))
def test_every_frame_is_read_and_a_cut_body_is_refused(
    parts: list[bytes], checksum: bool, level: int, cut: int
) -> None:
    body, ends = _frames(parts, checksum, level)
    whole = b"".join(parts)
    assert compression.zstd_decompress(body, len(whole)) == whole
    if whole:
        with pytest.raises(BodyTooLargeError):
            compression.zstd_decompress(body, len(whole) - 1)
    cut %= len(body)
    if cut not in ends:  # a cut at a frame boundary is a whole body of fewer frames
        with pytest.raises(WireError, match="cut off"):
            compression.zstd_decompress(body[:cut], 1 << 20)


@FUZZ
@given(parts=pieces, flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
                                    min_size=1, max_size=4))  # fmt: skip
def test_a_corrupted_body_is_the_callers_error(
    parts: list[bytes], flips: list[tuple[int, int]]
) -> None:
    body = bytearray(_frames(parts, True, 3)[0])
    for at, mask in flips:
        body[at % len(body)] ^= mask
    try:
        out = compression.zstd_decompress(bytes(body), 1 << 16)
    except WireError:
        return
    assert len(out) <= 1 << 16


def test_a_body_of_empty_blocks_is_refused_without_walking_them_all() -> None:
    """A valid frame of 3-byte empty blocks (review of session 32): walking 2.7M of them took
    1.7 s of the server's event loop per 8 MB body. Blocks beyond one per KiB of the limit
    (and 1024) are refused; a reserved block type too."""
    empty = zstandard.ZstdCompressor(write_content_size=False).compress(b"")
    header = empty[: zstandard.frame_header_size(empty)]
    many = header + b"\x00\x00\x00" * 5000 + b"\x01\x00\x00"  # raw, empty; the last one
    with pytest.raises(WireError, match="over 1025 blocks"):
        compression.zstd_decompress(many, 1024)
    reserved = header + ((3 << 1) | 1).to_bytes(3, "little")
    with pytest.raises(WireError, match="reserved block type"):
        compression.zstd_decompress(reserved, 1024)
    assert compression.zstd_decompress(header + b"\x00\x00\x00" * 10 + b"\x01\x00\x00", 1024) == b""
