"""One workload of the GPU check, run in a fresh process: ``child.py WORKLOAD [ARGS]``.

Prints one line ``CHECK-JSON:{...}``: what was compiled (Triton's own compile listener, and
the backend stages Triton ran), what kdb served (its per-process counts, when kdb was
loaded), a sha256 of every result's bytes (so arms compare bit for bit), whether each result
is right against a reference, and the seconds of each phase. Whether kdb is on is the
environment's business (``KDB_AUTO=1``), never this file's: the same code runs in every arm.

Workloads: ``triton [NAMES]`` (kernels.py, launched through torch), ``triton-target ARCH``
(the same kernels compiled for an explicit target, no GPU), ``jit-keys ARCH`` (the packed
kernels keyed as their launches key them, no GPU), ``inductor`` (a small model's
first training step under ``torch.compile``), ``cuda COMPILER ARCH`` (``kdb.cuda.compile``,
loaded and launched through CuPy, else cuda-core), ``cuda-serve ARCH FILE`` (the cubin kdb
serves, written to FILE), ``cuda-launch FILE``, ``pycuda kdb|plain`` (saxpy through kdb's or pycuda's SourceModule),
``opencl`` (pyopencl on the NVIDIA driver), ``hip ARCH|device [launch]``
(``kdb.hip.compile``; launched through ctypes on libamdhip64 on an AMD GPU).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

REPORT: dict = {"phases": {}}


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def phase(name: str, since: float) -> float:
    now = time.perf_counter()
    REPORT["phases"][name] = round(now - since, 4)
    return now


def count_host_builds() -> None:
    """Every C compiler run of Triton's host modules (the driver's utilities, the launchers):
    Triton's ``_build`` runs the compiler through ``subprocess.check_call`` in every version
    (3.2 on); the module each run built is reported, by file name."""
    import subprocess

    REPORT["host_builds"] = []
    check_call = subprocess.check_call

    def counting(cmd, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == "triton.runtime.build":
            out = cmd[cmd.index("-o") + 1] if "-o" in cmd else str(cmd[0])
            REPORT["host_builds"].append(os.path.basename(str(out)))
        return check_call(cmd, *args, **kwargs)

    subprocess.check_call = counting


def count_triton_compiles() -> None:
    """Triton's listener (3.4 and later) says hit or compile for every kernel; the backend's
    stages run only for a compile (every version): both are reported, and so are the host
    modules Triton builds with the C compiler (:func:`count_host_builds`)."""
    import triton
    import triton.compiler.compiler as tcc

    count_host_builds()

    REPORT["listener"] = []
    REPORT["stages_run"] = 0
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.compilation, "listener"):
        knobs.compilation.listener = lambda **kw: REPORT["listener"].append(
            "hit" if kw.get("cache_hit") else "compile")
    else:
        REPORT["listener"] = None  # this Triton has no listener
    make = tcc.make_backend

    def make_backend(target):
        backend = make(target)
        cls = type(backend)
        if not getattr(cls.add_stages, "_check_counted", False):
            inner = cls.add_stages

            def add_stages(self, *args, **kwargs):
                REPORT["stages_run"] += 1
                return inner(self, *args, **kwargs)

            add_stages._check_counted = True
            cls.add_stages = add_stages
        return backend

    tcc.make_backend = make_backend


def finish() -> None:
    """The counts kdb kept in this process (when it was loaded at all), then the JSON line."""
    if REPORT.get("listener") is not None:
        heard = REPORT["listener"].count("compile")
        REPORT["hits"] = REPORT["listener"].count("hit")
        # Another listener (a framework's own) may replace this one: the stages still count.
        REPORT["compiles"] = max(heard, REPORT["stages_run"])
        REPORT["listener_agrees"] = heard == REPORT["stages_run"]
    elif "stages_run" in REPORT:
        REPORT["compiles"] = REPORT["stages_run"]
    if "kdb" in sys.modules:
        from kdb import bookkeeping

        REPORT["kdb"] = {k: v for k, v in bookkeeping.process_counts().items()
                         if not k.endswith("seconds")}
        REPORT["kdb_file"] = sys.modules["kdb"].__file__
    REPORT["process_s"] = round(time.perf_counter() - T0, 4)
    print("CHECK-JSON:" + json.dumps(REPORT), flush=True)


# -- Triton through torch ---------------------------------------------------------------------

def triton_workload(names: list[str]) -> None:
    t = time.perf_counter()
    import torch
    import triton

    count_triton_compiles()
    import kernels

    t = phase("import", t)
    dev = torch.device("cuda")
    torch.cuda.init()
    t = phase("cuda_init", t)
    gen = torch.Generator(device="cpu").manual_seed(0)
    out, ok = {}, {}
    if "add" in names:
        n = 1 << 20
        x = torch.rand(n, generator=gen).to(dev)
        y = torch.rand(n, generator=gen).to(dev)
        z = torch.empty_like(x)
        kernels.add[(triton.cdiv(n, 1024),)](x, y, z, n, BLOCK=1024)
        out["add"], ok["add"] = z, bool(torch.equal(z, x + y))
    if "softmax" in names:
        x = torch.randn(1823, 781, generator=gen).to(dev)
        y = torch.empty_like(x)
        kernels.softmax[(x.shape[0],)](y, x, x.stride(0), y.stride(0), x.shape[1], BLOCK=1024)
        out["softmax"] = y
        ok["softmax"] = bool(torch.allclose(y, torch.softmax(x, dim=1), atol=1e-6, rtol=1e-5))
    if "layer_norm" in names:
        x = torch.randn(1151, 1000, generator=gen).to(dev)
        w = torch.rand(1000, generator=gen).to(dev)
        b = torch.rand(1000, generator=gen).to(dev)
        y = torch.empty_like(x)
        kernels.layer_norm[(x.shape[0],)](x, y, w, b, x.stride(0), x.shape[1], 1e-5, BLOCK=1024)
        ref = torch.nn.functional.layer_norm(x, (1000,), w, b, 1e-5)
        out["layer_norm"], ok["layer_norm"] = y, bool(torch.allclose(y, ref, atol=1e-4))
    if "matmul" in names:
        # Small integers: every product and sum is exact in fp32, so every configuration the
        # autotuner may pick gives the same bits, and so does torch.
        m = n = k = 512
        a = torch.randint(-3, 4, (m, k), generator=gen).to(dev, torch.float16)
        b = torch.randint(-3, 4, (k, n), generator=gen).to(dev, torch.float16)
        c = torch.empty((m, n), device=dev, dtype=torch.float16)

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

        kernels.matmul[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0),
                             b.stride(1), c.stride(0), c.stride(1))
        out["matmul"] = c
        ok["matmul"] = bool(torch.equal(c, (a.float() @ b.float()).half()))
        best = getattr(kernels.matmul, "best_config", None)
        REPORT["matmul_config"] = str(best) if best is not None else None
    torch.cuda.synchronize()
    t = phase("kernels", t)
    REPORT["digests"] = {k: digest(v.cpu().numpy().tobytes()) for k, v in out.items()}
    REPORT["ok"] = ok
    REPORT["triton"] = triton.__version__
    REPORT["target"] = str(triton.runtime.driver.active.get_current_target())


def triton_target_workload(arch: str) -> None:
    """No GPU: the same kernels compiled for ``arch`` through plain ``triton.compile`` (kdb,
    when on, is Triton's cache manager), the autotuned product once per configuration."""
    t = time.perf_counter()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    count_triton_compiles()
    import kernels

    t = phase("import", t)
    target = GPUTarget("cuda", int(arch[3:]), 32) if arch.startswith("sm_") else \
        GPUTarget("hip", arch, 64)
    ptr = "*fp32"
    jobs = [
        (kernels.add, {"x_ptr": ptr, "y_ptr": ptr, "out_ptr": ptr, "n": "i32",
                       "BLOCK": "constexpr"}, {"BLOCK": 1024}, None),
        (kernels.softmax, {"out_ptr": ptr, "in_ptr": ptr, "in_stride": "i32",
                           "out_stride": "i32", "n_cols": "i32", "BLOCK": "constexpr"},
         {"BLOCK": 1024}, None),
        (kernels.layer_norm, {"x_ptr": ptr, "y_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr,
                              "stride": "i32", "n_cols": "i32", "eps": "fp32",
                              "BLOCK": "constexpr"}, {"BLOCK": 1024}, None),
    ]
    mm = kernels.matmul.fn
    mm_sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", **{
        a: "i32" for a in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                           "stride_cm", "stride_cn")},
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    for cfg in kernels.CONFIGS:
        jobs.append((mm, mm_sig, dict(cfg.kwargs),
                     {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}))
    sizes = []
    for fn, sig, consts, options in jobs:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                           options=options)
        sizes.append(len(k.asm.get("cubin") or k.asm.get("hsaco") or b""))
    phase("kernels", t)
    REPORT["binaries"] = sizes
    REPORT["ok"] = {"binaries": all(sizes)}
    REPORT["triton"] = triton.__version__


def jit_keys_workload(arch: str) -> None:
    """No GPU: each packed kernel compiled as ``kernel[grid](...)`` in ``triton_workload``
    keys it (Triton's own binder and argument packing on stand-ins for the tensors, as
    tests/test_triton.py does), so that a pack that would miss on the GPU is seen here.
    Triton internals: needs ``JITFunction._pack_args`` (Triton 3.5 on)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    count_triton_compiles()
    import kernels

    class Tensor:  # what Triton's binder reads of a torch tensor
        def __init__(self, ptr):
            self.ptr, self.dtype = ptr, tl.float32

        def data_ptr(self):
            return self.ptr

    t = [Tensor(1 << (20 + i)) for i in range(4)]
    launches = {"add": (kernels.add, [t[0], t[1], t[2], 1 << 20], {"BLOCK": 1024}),
                "softmax": (kernels.softmax, [t[0], t[1], 781, 781, 781], {"BLOCK": 1024}),
                "layer_norm": (kernels.layer_norm, [*t, 1000, 1000, 1e-5], {"BLOCK": 1024})}
    target = GPUTarget("cuda", int(arch[3:]), 32)
    backend = make_backend(target)
    knobs = triton.knobs
    kw = {"debug": knobs.runtime.debug}  # and what this Triton's JITFunction.run adds
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kw[name] = getattr(knobs.compilation, name)
    for name, (fn, args, consts) in launches.items():
        bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(
            *args, **consts, **kw)
        options, sig, constexprs, attrs = fn._pack_args(backend, {**kw, **consts}, bound, spec,
                                                        opts)
        import kdb.triton

        kdb.triton.compile(ASTSource(fn, sig, constexprs, attrs), target, options.__dict__)
    REPORT["kernels"] = list(launches)
    REPORT["triton"] = triton.__version__


# -- torch.compile ----------------------------------------------------------------------------

def inductor_workload() -> None:
    """A small model's first training step: Inductor generates and compiles its Triton
    kernels (forward and backward); the caches it may use are the environment's."""
    t = time.perf_counter()
    import torch
    import triton

    count_triton_compiles()
    t = phase("import", t)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.GELU(),
        torch.nn.Linear(512, 256), torch.nn.Softmax(dim=-1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 256, device=dev)
    step = torch.compile(model)
    loss = step(x).square().mean()
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    phase("first_step", t)
    REPORT["first_step_s"] = round(time.perf_counter() - T0, 4)
    grads = b"".join(p.grad.detach().cpu().numpy().tobytes() for p in model.parameters())
    out = step(x)
    torch.cuda.synchronize()
    REPORT["digests"] = {"loss": digest(loss.detach().cpu().numpy().tobytes()),
                         "grads": digest(grads), "output": digest(out.detach().cpu().numpy()
                                                                  .tobytes())}
    # Inductor may pick another configuration of a reduction per process (it benchmarks
    # them): the values, to compare within a tolerance where the bits differ.
    REPORT["values"] = [float(loss), *(float(p.grad.double().abs().sum())
                                       for p in model.parameters()), float(out.double().sum())]
    REPORT["ok"] = {"finite": bool(torch.isfinite(loss).item())}
    REPORT["triton"], REPORT["torch"] = triton.__version__, torch.__version__


# -- CUDA -------------------------------------------------------------------------------------

CUDA_FILE = os.path.join(HERE, "saxpy.cu")
N = 1 << 16


def cuda_source() -> str:
    with open(CUDA_FILE, encoding="utf-8") as f:
        return f.read()


def launch_cubin(cubin: bytes) -> None:
    """Load ``cubin`` and run ``saxpy`` on N floats: CuPy where it is, else cuda-core."""
    import numpy as np

    x = np.arange(N, dtype=np.float32)
    y = np.ones(N, dtype=np.float32)
    want = 2.0 * x + y
    try:
        import cupy

        loader = f"cupy {cupy.__version__}"
    except ImportError:
        cupy = None
    if cupy is not None:
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        try:
            fn = cupy.RawModule(path=f.name).get_function("saxpy")
        finally:
            os.unlink(f.name)
        dx, dy = cupy.asarray(x), cupy.asarray(y)
        fn(((N + 255) // 256,), (256,), (np.float32(2.0), dx, dy, np.int32(N)))
        got = cupy.asnumpy(dy)
    else:
        got, loader = _launch_cuda_core(cubin, x, y)
    REPORT["loader"] = loader
    REPORT["ok"] = {"saxpy": bool(np.array_equal(got, want))}


def _launch_cuda_core(cubin: bytes, x, y):
    """The same launch through cuda-bindings' driver API (cuda-core's own layer)."""
    import ctypes

    import numpy as np
    from cuda.bindings import driver as cu

    def ok(result):
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {result[0]}")
        return result[1] if len(result) == 2 else result[1:]

    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    fn = ok(cu.cuModuleGetFunction(ok(cu.cuModuleLoadData(cubin)), b"saxpy"))
    dx, dy = ok(cu.cuMemAlloc(x.nbytes)), ok(cu.cuMemAlloc(y.nbytes))
    ok(cu.cuMemcpyHtoD(dx, x.ctypes.data, x.nbytes))
    ok(cu.cuMemcpyHtoD(dy, y.ctypes.data, y.nbytes))
    params = ((2.0, dx, dy, N), (ctypes.c_float, None, None, ctypes.c_int))
    ok(cu.cuLaunchKernel(fn, (N + 255) // 256, 1, 1, 256, 1, 1, 0, 0, params, 0))
    ok(cu.cuCtxSynchronize())
    got = np.empty_like(y)
    ok(cu.cuMemcpyDtoH(got.ctypes.data, dy, y.nbytes))
    return got, "cuda-bindings (driver API)"


def cuda_workload(compiler: str, arch: str) -> None:
    t = time.perf_counter()
    import kdb.cuda

    t = phase("import", t)
    cubin = kdb.cuda.compile(cuda_source(), arch=arch, compiler=compiler)
    t = phase("compile", t)
    REPORT["cubin"] = digest(cubin)
    REPORT["compiler"] = compiler
    launch_cubin(cubin)
    phase("launch", t)


def cuda_serve_workload(arch: str, path: str, compiler: str | None = None) -> None:
    """Whatever kdb serves here (with or without a compiler), written to ``path``."""
    import kdb.cuda

    found, ident, why = kdb.cuda.find_compiler(compiler)
    REPORT["compiler_here"] = found or f"none ({why})"
    REPORT["compiler_version"] = getattr(ident, "version", None)
    cubin = kdb.cuda.compile(cuda_source(), arch=arch, compiler=compiler)
    with open(path, "wb") as f:
        f.write(cubin)
    REPORT["cubin"] = digest(cubin)
    REPORT["ok"] = {"served": bool(cubin)}


def cuda_launch_workload(path: str) -> None:
    with open(path, "rb") as f:
        cubin = f.read()
    REPORT["cubin"] = digest(cubin)
    launch_cubin(cubin)


HIP_SAXPY = ('#include <hip/hip_runtime.h>\n'
             'extern "C" __global__ void saxpy(float *y, const float *x, float a, int n) {\n'
             '  int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
             '  if (i < n) y[i] += a * x[i];\n'
             '}\n')


def hip_workload(arch: str, launch: str = "") -> None:
    """``kdb.hip.compile`` of saxpy for ``arch`` ("device": the AMD GPU's own target ID);
    with "launch", loaded and run through kdb.backends.hip.loading (ctypes on libamdhip64)."""
    import ctypes
    import struct

    t = time.perf_counter()
    import kdb.hip
    from kdb.backends.hip import loading

    rt = loading.Runtime() if arch == "device" or launch else None
    target = rt.arch() if rt is not None and arch == "device" else arch
    t = phase("import", t)
    co = kdb.hip.compile(HIP_SAXPY, target)
    t = phase("compile", t)
    REPORT.update(code_object=digest(co), target=target,
                  code_object_target=kdb.hip.code_object_target(co))
    REPORT["ok"] = {"target": REPORT["code_object_target"] == kdb.hip.canonical(target)}
    if rt is None:
        return
    fn = rt.function(loading.load_module(rt, HIP_SAXPY, arch=target), "saxpy")
    n = 1 << 16
    x, y = struct.pack(f"{n}f", *range(n)), struct.pack(f"{n}f", *([1.0] * n))
    dx, dy = rt.to_device(x), rt.to_device(y)
    rt.launch(fn, ((n + 255) // 256,), (256,), [dy, dx, ctypes.c_float(2.0), ctypes.c_int(n)])
    out = rt.from_device(dy, 4 * n)
    rt.free(dx)
    rt.free(dy)
    REPORT["ok"]["saxpy"] = struct.unpack(f"{n}f", out) == tuple(1.0 + 2.0 * i
                                                                  for i in range(n))
    REPORT["digests"] = {"saxpy": digest(out)}
    phase("launch", t)


def pycuda_workload(mode: str) -> None:
    """saxpy through ``SourceModule``: kdb's (``mode`` "kdb") or pycuda's own ("plain"), in a
    context pycuda.autoinit makes; launched and checked."""
    t = time.perf_counter()
    import numpy as np
    import pycuda.autoinit  # noqa: F401 - the context
    import pycuda.driver as drv

    if mode == "kdb":
        from kdb.cuda import SourceModule
    else:
        from pycuda.compiler import SourceModule
    t = phase("import", t)
    mod = SourceModule(cuda_source())
    t = phase("compile", t)
    x = np.arange(N, dtype=np.float32)
    y = np.ones(N, dtype=np.float32)
    mod.get_function("saxpy")(np.float32(2.0), drv.In(x), drv.InOut(y), np.int32(N),
                              block=(256, 1, 1), grid=((N + 255) // 256, 1))
    phase("launch", t)
    REPORT["ok"] = {"saxpy": bool(np.array_equal(y, 2.0 * np.arange(N, dtype=np.float32) + 1))}
    REPORT["digests"] = {"saxpy": digest(y.tobytes())}
    REPORT["loader"] = f"pycuda {__import__('pycuda').VERSION_TEXT} ({mode} SourceModule)"


# -- OpenCL on the NVIDIA driver --------------------------------------------------------------

OPENCL = ("__kernel void k%d(__global float *a, __global const float *b) {"
          " int i = get_global_id(0); a[i] = a[i] * %d.0f + b[i]; }")


def opencl_workload(count: int = 20) -> None:
    t = time.perf_counter()
    import numpy as np
    import pyopencl as cl

    t = phase("import", t)
    platforms = [p for p in cl.get_platforms() if "NVIDIA" in p.name.upper()]
    if not platforms:
        raise SystemExit("no NVIDIA OpenCL platform: " + ", ".join(
            p.name for p in cl.get_platforms()))
    dev = platforms[0].get_devices()[0]
    REPORT["device"] = f"{dev.name}; driver {dev.driver_version}; {dev.version}"
    ctx = cl.Context([dev])
    queue = cl.CommandQueue(ctx)
    t = phase("context", t)
    a = np.arange(4096, dtype=np.float32)
    b = np.ones(4096, dtype=np.float32)
    mf = cl.mem_flags
    out, ok = [], True
    programs = [cl.Program(ctx, OPENCL % (i, i + 2)).build() for i in range(count)]
    t = phase("build", t)
    for i, prg in enumerate(programs):
        buf_a = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=a)
        buf_b = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=b)
        getattr(prg, f"k{i}")(queue, a.shape, None, buf_a, buf_b)
        got = np.empty_like(a)
        cl.enqueue_copy(queue, got, buf_a)
        ok = ok and bool(np.array_equal(got, a * (i + 2) + b))
        out.append(got.tobytes())
    queue.finish()
    phase("launch", t)
    binary = programs[0].get_info(cl.program_info.BINARIES)[0]
    REPORT["binary"] = {"bytes": len(binary), "starts": binary[:48].decode("latin-1")}
    REPORT["digests"] = {"all": digest(b"".join(out))}
    REPORT["ok"] = {"results": ok}
    REPORT["compiles_without_kdb"] = count


def main(argv: list[str]) -> None:
    what, args = argv[0], argv[1:]
    try:
        if what == "triton":
            triton_workload(args or ["add", "softmax", "layer_norm", "matmul"])
        elif what == "triton-target":
            triton_target_workload(args[0])
        elif what == "jit-keys":
            jit_keys_workload(args[0])
        elif what == "inductor":
            inductor_workload()
        elif what == "cuda":
            cuda_workload(args[0], args[1])
        elif what == "cuda-serve":
            cuda_serve_workload(*args[:3])
        elif what == "cuda-launch":
            cuda_launch_workload(args[0])
        elif what == "pycuda":
            pycuda_workload(args[0])
        elif what == "opencl":
            opencl_workload()
        elif what == "hip":
            hip_workload(*args[:2])
        else:
            raise SystemExit(f"unknown workload {what!r}")
    finally:
        finish()


if __name__ == "__main__":
    main(sys.argv[1:])
