#!/usr/bin/env bash
# Regenerate tinker_sr/wire/tinker_public_pb2.py (+ .pyi) from tinker_public.proto.
#
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: tinker_sr/wire, i.e. in place)
# Needs the pinned generator: pip install grpcio-tools==1.85.1
# The generated module is committed; tests/test_wire.py regenerates into a temp dir and
# checks that the committed file is byte-identical.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$here/tinker_sr/wire}"
want="1.85.1"
python="${PYTHON:-python}"

have="$("$python" -c 'from importlib.metadata import version; print(version("grpcio-tools"))' 2>/dev/null || true)"
if [[ "$have" != "$want" ]]; then
  echo "gen_proto.sh: need grpcio-tools==$want (found: ${have:-none}); run: pip install grpcio-tools==$want" >&2
  exit 2
fi

mkdir -p "$out"
# -I points at the proto's own directory so the descriptor's file name is exactly
# "tinker_public.proto", the name the official SDK registers.
"$python" -m grpc_tools.protoc \
  -I "$here/tinker_sr/wire" \
  --python_out="$out" \
  --pyi_out="$out" \
  "$here/tinker_sr/wire/tinker_public.proto"
