"""zstd request bodies (``Content-Encoding: zstd``): compression for the remote client, bounded
and whole-body decompression for the server (RFC 8878: a body is one or more frames)."""

from __future__ import annotations

import io

import zstandard

from .errors import BodyTooLargeError, WireError

__all__ = ["zstd_compress", "zstd_decompress"]


def zstd_compress(body: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(body)


_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = 0x184D2A50  # the 16 magics 0x184D2A50..5F (RFC 8878 3.1.2)


def _zstd_frames_end(body: bytes, max_blocks: int) -> None:
    """Walk a zstd body's frames by their headers (RFC 8878: one or more frames, each ending in
    a last block and its optional checksum) without decompressing: a body cut off inside a frame,
    or with bytes after the last frame that are not a frame, is refused (a decoder that stopped
    early would hand on a request with its tail silently missing). More than ``max_blocks``
    blocks is refused too: a body of empty 3-byte blocks would keep this loop busy for long."""
    view, pos, blocks = memoryview(body), 0, 0
    cut = WireError(
        "body is marked Content-Encoding: zstd but its frame is cut off (the body is "
        "incomplete); send the whole compressed body"
    )
    while pos < len(body):
        if pos + 4 > len(body) and _ZSTD_MAGIC.to_bytes(4, "little").startswith(view[pos:]):
            raise cut  # a body cut inside a frame's magic number
        magic = int.from_bytes(view[pos : pos + 4], "little")
        if magic & 0xFFFFFFF0 == _SKIPPABLE_MAGIC:  # a skippable frame: 4-byte size, then data
            if pos + 8 > len(body):
                raise cut
            pos += 8 + int.from_bytes(view[pos + 4 : pos + 8], "little")
        elif magic == _ZSTD_MAGIC:
            try:
                header = zstandard.frame_header_size(view[pos:])
                checksum = zstandard.get_frame_parameters(view[pos:]).has_checksum
            except zstandard.ZstdError:
                raise cut from None
            pos += header
            last = 0
            while not last:
                if pos + 3 > len(body):
                    raise cut
                block = int.from_bytes(view[pos : pos + 3], "little")
                last, kind, size = block & 1, (block >> 1) & 3, block >> 3
                blocks += 1
                if kind == 3 or blocks > max_blocks:
                    raise WireError(
                        "body is marked Content-Encoding: zstd but "
                        + (
                            "has a reserved block type"
                            if kind == 3
                            else f"has over {max_blocks} blocks"
                        )
                        + "; send one body compressed in the usual blocks"
                    )
                pos += 3 + (1 if kind == 1 else size)  # an RLE block is one byte repeated
            pos += 4 if checksum else 0
        else:
            what = (
                "is not a zstd frame"
                if pos == 0
                else f"has {len(body) - pos} bytes after its last zstd frame"
            )
            raise WireError(
                f"body is marked Content-Encoding: zstd but {what}; send one compressed body"
            )
    if pos > len(body) or not body:
        raise cut


def zstd_decompress(body: bytes, max_bytes: int) -> bytes:
    """Decompress a zstd body (every frame in it), refusing to produce more than ``max_bytes``
    and refusing a body that is cut off or carries trailing bytes (`_zstd_frames_end`)."""
    # Real compressors fill blocks (up to 128 KiB each); a block per KiB is already generous.
    _zstd_frames_end(body, max_blocks=max_bytes // 1024 + 1024)
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(body), read_across_frames=True
        )
        out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as e:
        raise WireError(
            f"body is marked Content-Encoding: zstd but is not a zstd frame ({e})"
        ) from None
    if len(out) > max_bytes:
        raise BodyTooLargeError(
            f"decompressed body exceeds the server's limit of {max_bytes} bytes; send smaller "
            "forward_backward chunks"
        )
    return out
