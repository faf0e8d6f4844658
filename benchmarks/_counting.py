"""What the benchmark workloads share: a count of the programs a client asks pyopencl to build,
taken around ``pyopencl.Program.build`` (the build itself, kdb's or pyopencl's, untouched).
Imported after ``kdb.opencl.install()``, so it counts the calls that reach kdb too."""

import pyopencl as cl

builds = [0]
_build = cl.Program.build


def _counted(self, *args, **kwargs):
    builds[0] += 1
    return _build(self, *args, **kwargs)


cl.Program.build = _counted
