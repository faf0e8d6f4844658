"""Back ends: each turns a device request into hash attributes (arch id, compiler identity,
the headers a build reads: ``includes``, ``digests``), compiles on a miss and loads a binary.
OpenCL: the ``opencl`` package (``keys``, ``archs``, ``stores``, ``binaries``, ``poclbin``,
``early``, ``refresh``, ``packing``); CUDA: the ``cuda`` package (``nvcc``, ``nvrtc``, ``keys``,
``search``, ``builds``, ``loading``, ``packing``); Triton: the ``triton`` package (``cache``, ``chosen``, ``groups``,
``hostmods``, ``packing``, ``targets``); torch.compile: the ``torch`` package (``entries``,
``cpp``, ``targets``); ``common`` (source text, labels), ``cloptions`` (OpenCL's options) and
``fallback`` (the newest stored build where no compiler is installed) serve them. Imports the
core and the wings below the policy, never a front end; only the device front ends import a
back end, and the others find one through :mod:`kdb.registry`.
"""
