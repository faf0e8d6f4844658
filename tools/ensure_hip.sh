#!/usr/bin/env bash
# Make Debian's HIP toolchain (hipcc: ROCm 5.2's clang, HIP headers, device libraries; HIPRTC
# in libamdhip64-5, its builtins in libhiprtc-builtins5) available for tests/test_hip.py.
# `make test` runs this first, so the HIP tests run on a fresh Debian/Ubuntu machine.
#
# Installs `hipcc` only when it is absent and this runs as root with apt-get (CI); otherwise
# it says why and the HIP tests skip with that reason. It never fails the build.
# No GPU is needed: hipcc and HIPRTC compile for an explicit gfx target.
set -uo pipefail

command -v hipcc >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_hip: installing the HIP toolchain (apt-get install hipcc) for the HIP tests"
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -qq && apt-get install -y -qq --no-install-recommends hipcc \
            libhiprtc-builtins5 >/dev/null && command -v hipcc >/dev/null 2>&1; then
        exit 0
    fi
    echo "ensure_hip: installing hipcc failed; tests/test_hip.py will skip" >&2
else
    echo "ensure_hip: no hipcc here, and installing it needs root and apt-get;" \
         "tests/test_hip.py will skip. Install it with: sudo apt-get install hipcc" >&2
fi
exit 0
