"""`kdb demo`: a cold and a warm run of real OpenCL kernels in fresh processes."""

from __future__ import annotations

import json

import pytest

from kdb.demo import runs as demo
from kdb.errors import InvalidArgumentError


def test_demo_cold_run_compiles_every_program_and_warm_run_none(tmp_path, capsys):
    pytest.importorskip("pyopencl")
    out = tmp_path / "demo.json"

    code = demo.main(json_out=str(out), cache_dir=tmp_path / "cache")

    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    doc = json.loads(out.read_text())
    cold, warm = doc["runs"]["cold"], doc["runs"]["warm"]
    n = len(demo.PROGRAMS)
    assert len({(p.file, p.options) for p in demo.PROGRAMS}) == n  # distinct programs
    assert cold["kernels"] == warm["kernels"] == n
    assert cold["compiles"] == n
    assert warm["compiles"] == 0
    assert cold["pid"] != warm["pid"]  # two fresh processes
    for run in (cold, warm):
        assert run["ok"] and run["exit_code"] == 0
        assert [r["name"] for r in run["results"] if r["ok"]] == [p.name for p in demo.PROGRAMS]
    assert doc["ok"] and doc["failures"] == []
    # The cold run's missing-system-db warning reached the user.
    assert cold["missing_system_db_warning"] and doc["missing_system_db_warning_cold"]
    assert "no system kernel database for arch" in printed.out
    # The cache the user was given is where the binaries went.
    assert (tmp_path / "cache" / "v1" / f"{cold['arch']}.kdb").is_file()
    assert "warm" in printed.out and "compiles" in printed.out


def test_demo_selects_programs_by_count_or_name_and_rejects_others():
    assert [p.name for p in demo.select(2)] == ["axpy_f32", "axpy_f64"]
    assert [p.name for p in demo.select("axpy_f32, scan_wg")] == ["axpy_f32", "scan_wg"]
    assert demo.select(None) == list(demo.PROGRAMS)
    with pytest.raises(InvalidArgumentError, match="choose from"):
        demo.select(["no_such_kernel"])
    with pytest.raises(InvalidArgumentError, match="programs"):
        demo.select(len(demo.PROGRAMS) + 1)


def test_demo_names_a_repeated_warning_for_what_it_is(capsys):
    """A warm run's stderr repeating the cold run's: only the missing-system-db warning is
    called that; another repeated warning (a refused cache, say) is not."""
    shown: set[str] = set()
    trust = "kdb: /c/v1/x.kdb is refused: group or others can write it"
    demo._show_stderr("cold", trust, shown)
    demo._show_stderr("warm", trust, shown)
    out = capsys.readouterr().out
    assert "1 line(s) as in the cold run (each process gives its warnings once)" in out
    assert "missing-system-db" not in out

    missing = f"kdb: {demo.MISSING_SYSTEM_DB} for arch a: kernels compile at first use"
    demo._show_stderr("cold", missing, shown)
    demo._show_stderr("warm", missing, shown)
    assert "(the missing-system-db warning is given once per process)" in capsys.readouterr().out
