#!/usr/bin/env bash
# Build this project's system-database wheels (kdb-system-<arch>) for the arches of this
# machine's OpenCL devices (here: PoCL's CPU arch) into prebuilt/dist/, from the manifest
# prebuilt/demo.toml. Prints the pack summary (entries, sizes, seconds) and the files built.
#
# Usage: tools/build_prebuilt.sh [VERSION] [extra `kdb pack` options, e.g. --keep-going]
#   VERSION defaults to kdb's own version. PYTHON picks the interpreter (default: .venv's,
#   which needs kdb with the [opencl,pack] extras: `make setup`).
#
# OpenCL arches can only be built where such a device is present. CUDA arches (sm_80, sm_90,
# ...) cross-compile with nvcc or NVRTC, no GPU needed, for kernels with backend = "cuda"; the demo's
# manifest holds OpenCL kernels only, so there is nothing to build for them yet; once it
# has some, add their arches with KDB_PACK_ARCHES="sm_80 sm_90".
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    VERSION=$1
    shift
else
    VERSION=$("$PYTHON" -c 'import kdb; print(kdb.__version__)')
fi
OUT=prebuilt/dist

arch_args=(--arch native)
for a in ${KDB_PACK_ARCHES:-}; do arch_args+=(--arch "$a"); done

mkdir -p "$OUT"
start=$(date +%s.%N)
"$PYTHON" -m kdb.cli pack "${arch_args[@]}" --manifest prebuilt/demo.toml \
    --version "$VERSION" --out "$OUT" "$@"
end=$(date +%s.%N)

echo
echo "built in $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }') s (wall clock):"
ls -l "$OUT"
