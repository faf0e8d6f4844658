"""The ``trust`` scenario: what signed entries cost a warm start, and what signing a pack costs.

- **a warm start** of a fresh process (import pyopencl, a PoCL context, 20 OpenCL kernels
  through ``kdb.opencl.build``, every one a hit) from the user tier and from the shared tier,
  each without a trust policy and with one (``KDB_TRUSTED_KEYS``; for the user tier also with
  ``KDB_REQUIRE_SIGNED=1``, the only way a user-tier hit is verified). Process wall time,
  spawn to exit; arms interleaved round by round. The shared arms start each run with an
  empty user tier, so all 20 are served by the server (and copied home, as always). The
  shared tier needs PostgreSQL's server binaries (``tools/ensure_postgres.sh``); the test
  suite's throw-away server class starts one on 127.0.0.1, and without them those arms are
  skipped.
- **signing a pack**: ``write_system_db`` of 1,000 entries (``--quick``: 100) with and without
  ``sign=``, from the same user file of real-size binaries.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from _harness import PYTHON, Metric, Outcome, Workspace, at_most, command

KERNELS = 20

PROGRAM = '''
import json, time
t0 = time.perf_counter()
import pyopencl as cl
plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
import kdb.opencl, kdb.bookkeeping
t1 = time.perf_counter()
for i in range(%d):
    kdb.opencl.build(ctx, "__kernel void t%%d(__global float *a) { a[get_global_id(0)] += %%d.0f; }"
                     %% (i, i), name="t%%d" %% i)
t2 = time.perf_counter()
print("BENCH-JSON:" + json.dumps({"compiles": len(kdb.bookkeeping.records()), "build": t2 - t1}))
''' % KERNELS


def _server(ws: Workspace):
    """The test suite's throw-away PostgreSQL server, or ``(None, why)``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    try:
        import test_shared
    except Exception as err:  # noqa: BLE001 - pytest or psycopg missing
        return None, f"cannot import the test suite's server ({err})"
    try:
        return test_shared._make_server(), ""
    except BaseException as err:  # noqa: BLE001 - pytest.skip raises a BaseException
        return None, str(err) or type(err).__name__


def trust(ws: Workspace, o: Outcome) -> None:
    from kdb.signing import keyfiles

    o.title = (f"Signed entries: a warm start of {KERNELS} OpenCL kernels from the user and the "
               "shared tier, with and without a trust policy; signing a pack")
    program = ws.fresh("trust-program") / "program.py"
    program.write_text(PROGRAM)
    keys = ws.fresh("trust-keys")
    key_id = keyfiles.generate(str(keys / "ci.pem"), str(keys / "ci.pub.pem"))
    pocl = ws.fresh("trust-pocl")
    policy = {"KDB_TRUSTED_KEYS": str(keys / "ci.pub.pem")}
    server, why = _server(ws)
    url = None
    try:
        if server is not None:
            server.sql('CREATE DATABASE "bench_trust"')
            url = server.url("bench_trust")
        user = ws.fresh("trust-user")
        # Prime: compiled once, signed, stored in the user tier and published to the server.
        prime = command([PYTHON, str(program)], ws.env(
            KDB_CACHE_DIR=user, POCL_CACHE_DIR=pocl, KDB_SIGNING_KEY=keys / "ci.pem",
            KDB_SHARED_URL=url), timeout=900)
        assert prime.data["compiles"] == KERNELS, prime.data
        arms = {"user": ("user tier, no policy", dict(KDB_CACHE_DIR=user)),
                "user_trusted": ("user tier, KDB_TRUSTED_KEYS (user tier not covered)",
                                 dict(KDB_CACHE_DIR=user, **policy)),
                "user_required": ("user tier, KDB_TRUSTED_KEYS + KDB_REQUIRE_SIGNED=1",
                                  dict(KDB_CACHE_DIR=user, KDB_REQUIRE_SIGNED="1", **policy))}
        if url is not None:
            arms["shared"] = ("shared tier, no policy", dict(KDB_SHARED_URL=url))
            arms["shared_trusted"] = ("shared tier, KDB_TRUSTED_KEYS",
                                      dict(KDB_SHARED_URL=url, **policy))
        warm = o.table(f"a fresh process, {KERNELS} kernels, every one a hit (signed by key "
                       f"{key_id})", "user",
                       [Metric("wall", "process wall", unit="ms"),
                        Metric("build", "build phase", unit="ms"),
                        Metric("compiles", "compiles", unit="n", ratio=False)],
                       note="shared arms: an empty user tier each run, every kernel from the "
                            "server" + ("" if url else f"; skipped: {why}"))
        for arm, (label, _) in arms.items():
            warm.arm(arm, label)
        names = list(arms)
        for r in range(ws.opts.n(9)):
            for arm in (names if r % 2 == 0 else names[::-1]):
                label, extra = arms[arm]
                if arm.startswith("shared"):
                    extra = dict(extra, KDB_CACHE_DIR=ws.fresh("trust-node"))
                ws.log(f"trust: warm start {r + 1}, {arm}")
                p = command([PYTHON, str(program)], ws.env(POCL_CACHE_DIR=pocl, **extra),
                            timeout=900)
                warm.add(arm, "wall", p.wall)
                warm.add(arm, "build", p.data["build"])
                warm.add(arm, "compiles", p.data["compiles"])
        o.checks.append(at_most("trust: warm start of 20 kernels from the user tier, "
                                "KDB_TRUSTED_KEYS vs no policy",
                                warm.ratio("user_trusted", "wall"), 1.05))
        o.checks.append(at_most("trust: warm start of 20 kernels from the user tier, "
                                "KDB_REQUIRE_SIGNED=1 (every hit verified) vs no policy",
                                warm.ratio("user_required", "wall"), 1.05))
        if url is not None:
            o.checks.append(at_most("trust: warm start of 20 kernels from the shared tier, "
                                    "KDB_TRUSTED_KEYS vs no policy",
                                    warm.ratio("shared_trusted", "wall", "shared"), 1.05))
    finally:
        if server is not None:
            server.close()
    _signing_a_pack(ws, o, keys / "ci.pem")


def _signing_a_pack(ws: Workspace, o: Outcome, key: Path) -> None:
    import os

    from kdb import HashAttributes
    from kdb.file.kernelfile import Entry, KernelFile
    from kdb.pack.systemfile import write_system_db
    from kdb.signing import keyfiles, policy as signing

    n = 100 if ws.opts.quick else 1000
    src = ws.fresh("trust-pack-src") / "bench.kdb"
    f = KernelFile(src, tier="user", readonly=False)
    entries = []
    for i in range(n):
        a = HashAttributes(backend="bench", source=f"kernel {i}", arch="bench", name=f"k{i}")
        raw = os.urandom(2048) + bytes(6000)  # a PoCL binary's size, partly compressible
        entries.append(Entry(a.key, a.arch, a.backend, a.name, a.encoded().decode(), raw))
    f.write(entries, [], {}, {}, cap=0)
    f.close()
    pk, kid = keyfiles.load_private(str(key))
    signer = signing.Policy({}, False, pk, kid)
    t = o.table(f"write_system_db of {n:,} entries (kdb pack's writer)", "unsigned",
                [Metric("seconds", "pack", unit="s")])
    t.arm("unsigned", "unsigned")
    t.arm("signed", f"--sign (Ed25519, key {kid})")
    # One untimed write first: the first pays the imports and the file cache, and with one
    # run an arm (--quick) it made signing look cheaper than not (-3,305 us an entry).
    write_system_db(ws.fresh("trust-pack") / "bench.kdb", "bench", [src], sign=signer)
    for r in range(ws.opts.n(5)):
        for arm in (("unsigned", "signed") if r % 2 == 0 else ("signed", "unsigned")):
            dest = ws.fresh("trust-pack") / "bench.kdb"
            start = time.perf_counter()
            write_system_db(dest, "bench", [src], sign=signer if arm == "signed" else None)
            t.add(arm, "seconds", time.perf_counter() - start)
    signed, unsigned = t.median("signed", "seconds"), t.median("unsigned", "seconds")
    o.info["sign_1000_seconds"] = signed
    o.info["sign_cost_per_entry_us"] = (signed - unsigned) / n * 1e6 if signed and unsigned else None
    o.notes.append(f"signing a pack of {n:,} entries: {signed:.2f} s vs {unsigned:.2f} s "
                   f"unsigned ({o.info['sign_cost_per_entry_us']:.0f} us an entry)")
