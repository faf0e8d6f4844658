"""Back ends: each turns a device request into hash attributes (arch id, compiler identity,
the headers a build reads: ``includes``, ``digests``), compiles on a miss and loads a binary.
OpenCL: the ``opencl`` package (``keys``, ``stores``, ``binaries``); CUDA: the ``cuda`` package
(``nvcc``, ``nvrtc``, ``keys``, ``builds``, ``loading``); ``common`` (source text, labels) serves
both; ``fallback`` serves the newest stored
build where no compiler is installed. Imports the core and the wings below the policy, never
a front end; only the device front ends import a back end.
"""
