"""codec round trips, and kdb.file.zstd: the C extension loaded without zstandard's package init,
or the package itself where that is not possible, the two interchangeable."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys

import pytest

from kdb.file import codec
from kdb.file import zstd as kzstd

RAW = bytes(range(256)) * 300  # compresses well: stored as zstd

cpython_only = pytest.mark.skipif(sys.implementation.name != "cpython",
                                  reason="the fast path applies to CPython only")


def _run(code: str, tmp_path, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object, returned here."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHON_ZSTANDARD_IMPORT_POLICY"}
    environ.update(env)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=environ, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


_ROUND_TRIP = """\
import json, sys
from kdb.file import codec
raw = bytes(range(256)) * 300
kind, blob = codec.encode(raw)
ok = codec.decode(kind, blob, len(raw), codec.checksum(raw), thorough=True) == raw
out = {"kind": kind, "ok": ok, "module": codec._zstd.__name__,
       "typing": "typing" in sys.modules, "platform": "platform" in sys.modules,
       "blob": blob.hex()}
import zstandard
out.update(backend=zstandard.backend,
           interop=zstandard.ZstdDecompressor().decompress(blob) == raw,
           back=codec.decode("zstd", zstandard.ZstdCompressor(write_checksum=True).compress(raw),
                             len(raw), codec.checksum(raw)) == raw,
           same_classes=(zstandard.ZstdError is codec._zstd.ZstdError
                         and zstandard.ZstdDecompressor is codec._zstd.ZstdDecompressor),
           registered=sys.modules.get("zstandard.backend_c") is codec._zstd)
import zstandard.backend_c as ext
out["import_ext"] = ext is sys.modules["zstandard.backend_c"]
print(json.dumps(out))
"""


def test_round_trip_in_process():
    kind, blob = codec.encode(RAW)
    assert kind == codec.ZSTD and len(blob) < len(RAW)
    assert codec.decode(kind, blob, len(RAW), codec.checksum(RAW), thorough=True) == RAW
    assert codec.decode(kind, blob[:-1], len(RAW), codec.checksum(RAW)) is None  # damaged


@cpython_only
def test_a_hit_decodes_without_zstandards_package_init(tmp_path):
    out = _run(_ROUND_TRIP, tmp_path)
    assert out["module"] == "zstandard.backend_c"  # the fast path was taken
    assert out["ok"] and out["kind"] == "zstd"
    assert not out["typing"] and not out["platform"]  # what the package's __init__ imports
    # A later `import zstandard` works and is the same zstd: same module, same classes.
    assert out["backend"] == "cext" and out["registered"] and out["same_classes"]
    assert out["interop"] and out["back"] and out["import_ext"]


def test_fallback_when_another_backend_is_asked_for(tmp_path):
    pytest.importorskip("cffi")
    out = _run(_ROUND_TRIP, tmp_path, PYTHON_ZSTANDARD_IMPORT_POLICY="cffi")
    assert out["module"] == "zstandard" and out["backend"] == "cffi"  # the package, as asked
    assert out["ok"] and out["interop"] and out["back"] and out["same_classes"]
    # Frames written through the fallback decode through the fast path, and back.
    raw = bytes(range(256)) * 300
    assert codec.decode("zstd", bytes.fromhex(out["blob"]), len(raw), codec.checksum(raw)) == raw


def test_fallback_where_the_package_would_not_pick_the_extension(tmp_path):
    patch = "import kdb.file.zstd\nkdb.zstd._package_would_pick_cext = lambda: False\n"
    out = _run(patch + _ROUND_TRIP, tmp_path)
    assert out["module"] == "zstandard" and out["backend"] == "cext"
    assert out["ok"] and out["interop"] and out["back"] and out["same_classes"]


def test_fallback_when_zstandard_is_already_imported(tmp_path):
    out = _run("import zstandard\n" + _ROUND_TRIP, tmp_path)
    assert out["module"] == "zstandard" and out["ok"] and out["interop"]


def test_load_without_the_fast_path_is_the_package():
    import zstandard

    assert kzstd.load(fast=False) is zstandard
    assert kzstd.load() is zstandard  # already imported here: nothing to save


@pytest.mark.parametrize("layout", ["no extension", "not loadable", "python module"])
def test_no_fast_path_for_another_layout(layout, tmp_path, monkeypatch):
    """A package whose ``backend_c`` is missing, broken or pure Python: no module is
    registered, and :func:`kdb.file.zstd.load` would import the package instead."""
    pkg = tmp_path / "fakezstd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if layout == "not loadable":
        (pkg / f"backend_c{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not ELF")
    elif layout == "python module":
        (pkg / "backend_c.py").write_text("ZstdError = ValueError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(kzstd, "PACKAGE", "fakezstd")
    monkeypatch.setattr(kzstd, "EXTENSION", "fakezstd.backend_c")
    assert kzstd._extension() is None
    assert "fakezstd.backend_c" not in sys.modules


@pytest.mark.parametrize("policy, fast", [("default", True), ("cext", True),
                                          ("cffi_fallback", True), ("cffi", False),
                                          ("rust", False), ("bogus", False)])
def test_the_fast_path_follows_zstandards_import_policy(policy, fast, monkeypatch):
    monkeypatch.setenv("PYTHON_ZSTANDARD_IMPORT_POLICY", policy)
    assert kzstd._package_would_pick_cext() is (fast and sys.implementation.name == "cpython")
