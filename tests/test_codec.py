"""codec round trips: zstd frames that zstandard itself reads, with their own checksum."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kdb.file import codec

RAW = bytes(range(256)) * 300  # compresses well: stored as zstd

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
out = {"kind": kind, "ok": ok}
import zstandard
out.update(backend=zstandard.backend,
           interop=zstandard.ZstdDecompressor().decompress(blob) == raw,
           back=codec.decode("zstd", zstandard.ZstdCompressor(write_checksum=True).compress(raw),
                             len(raw), codec.checksum(raw)) == raw,
           )
print(json.dumps(out))
"""


def test_round_trip_in_process():
    kind, blob = codec.encode(RAW)
    assert kind == codec.ZSTD and len(blob) < len(RAW)
    assert codec.decode(kind, blob, len(RAW), codec.checksum(RAW), thorough=True) == RAW
    assert codec.decode(kind, blob[:-1], len(RAW), codec.checksum(RAW)) is None  # damaged


def test_frames_are_zstandards_own_in_a_fresh_process(tmp_path):
    out = _run(_ROUND_TRIP, tmp_path)
    assert out["kind"] == "zstd" and out["ok"] and out["interop"] and out["back"]
