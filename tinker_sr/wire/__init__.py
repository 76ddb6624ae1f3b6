"""The Tinker wire codec, shared by the server and `RemoteBackend` so they cannot drift.

* `tinker_sr.wire.proto`: protobuf bodies (forward_backward requests, forward/backward and
  sample results) <-> public types.
* `tinker_sr.wire.messages`: JSON request bodies, future payloads and error payloads.
* `tinker_sr.wire.compression`: zstd request bodies (bounded, every frame read).
* `tinker_public.proto` / `tinker_public_pb2.py`: the schema and its generated module
  (regenerate with ``scripts/gen_proto.sh``).
"""

from .errors import BodyTooLargeError, WireError

__all__ = ["WireError", "BodyTooLargeError"]
