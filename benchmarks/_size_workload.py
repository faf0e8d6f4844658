"""One process of the ``scale`` scenario's size table: what a pyopencl program builds, each
build through kdb (``kdb.opencl.install()``), on PoCL. ``python _size_workload.py``: the
demo's programs with their options, pyopencl's scans of two dtypes (generated sources of
about 20 KB each) and one elementwise program with pyopencl's complex-number header as its
preamble under four options (one source, four entries). Stores before it exits
(``KDB_STORE_AT_EXIT=wait``)."""

from pathlib import Path

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

import kdb
import kdb.opencl
from kdb.demo.programs import KERNEL_DIR, PROGRAMS

kdb.opencl.install()

from pyopencl.scan import ExclusiveScanKernel, InclusiveScanKernel  # noqa: E402


def main() -> None:
    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    queue = cl.CommandQueue(ctx)
    for p in PROGRAMS:
        source = (KERNEL_DIR / p.file).read_text()
        kdb.opencl.build(ctx, source, [*p.options, "-I", str(KERNEL_DIR)], name=p.name)
    for dtype in (np.int32, np.float32):
        a = cla.to_device(queue, np.arange(100, dtype=dtype))
        InclusiveScanKernel(ctx, dtype, "a+b", neutral="0")(a)
        ExclusiveScanKernel(ctx, dtype, "a+b", neutral="0")(a)
    preamble = (Path(cl.__file__).parent / "cl" / "pyopencl-complex.h").read_text()
    source = preamble + ("\n__kernel void mul(__global cfloat_t *a) { size_t i = "
                         "get_global_id(0); a[i] = cfloat_mul(a[i], cfloat_new(SCALE, 0)); }\n")
    for scale in ("1.0f", "2.0f", "3.0f", "0.5f"):
        kdb.opencl.build(ctx, source, ["-DSCALE=" + scale], name="mul")
    kdb.default_db().flush()


if __name__ == "__main__":
    main()
