"""benchmarks/run.py: one command prints tables and writes JSON of a known shape.

The cheapest scenario (``hit``) runs for real in --quick mode; no timing is asserted, only
that every arm was measured and every ratio is taken against the reference arm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "benchmarks" / "run.py"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def quick_hit(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "hit.json"
    proc = _run("--quick", "--only", "hit", "--json", str(out), "--silent")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc, json.loads(out.read_text(encoding="utf-8"))


def test_quick_hit_writes_only_that_scenario(quick_hit):
    _, data = quick_hit
    assert set(data) == {"meta", "scenarios"}
    assert list(data["scenarios"]) == ["hit"]
    meta = data["meta"]
    assert meta["quick"] is True
    assert meta["kdb_version"]
    assert meta["seconds"] > 0
    hit = data["scenarios"]["hit"]
    assert hit["status"] == "ok", hit["reason"]
    assert {t["name"] for t in hit["tables"]} == {"fresh process, spawn to exit",
                                                  "warm process, one hit"}


def test_every_arm_has_a_median_and_a_ratio_to_the_reference(quick_hit):
    _, data = quick_hit
    for table in data["scenarios"]["hit"]["tables"]:
        keys = [m["key"] for m in table["metrics"]]
        assert keys == [str(4 * 1024), str(70 * 1024), str(1 << 20)]
        arms = {row["arm"]: row for row in table["rows"]}
        assert table["reference"] in arms
        assert "kdb" in arms
        for row in table["rows"]:
            assert row["label"]
            assert set(row["metrics"]) == set(keys), row["arm"]
            for cell in row["metrics"].values():
                assert cell["median"] > 0
                assert cell["n"] == len(cell["samples"]) >= 1
                assert cell["min"] <= cell["median"] <= cell["max"]
                assert cell["ratio"] is not None
        for cell in arms[table["reference"]]["metrics"].values():
            assert cell["ratio"] == pytest.approx(1.0)


def test_checks_name_a_design_figure_and_its_target(quick_hit):
    _, data = quick_hit
    checks = data["scenarios"]["hit"]["checks"]
    assert len(checks) == 1  # the warm hit; a bare interpreter is reported, held to nothing
    for c in checks:
        assert set(c) == {"figure", "target", "value", "met", "detail"}
        assert c["target"].startswith("<= ")
        assert c["value"] > 0
        assert c["met"] in (True, False)


def test_tables_are_printed(quick_hit):
    proc, _ = quick_hit
    assert "=== hit:" in proc.stdout
    assert "python -c pass" in proc.stdout
    assert "import kdb + 1 hit" in proc.stdout
    assert "kdb's figures (docs/design.md)" in proc.stdout


def test_unknown_scenario_is_refused(tmp_path):
    proc = _run("--only", "nosuch", "--json", str(tmp_path / "x.json"))
    assert proc.returncode == 2
    assert "unknown scenario" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_every_scenario_is_registered_and_documented():
    """run.py --only accepts each scenario, and the README's benchmark table has a row for it
    (the script scenario of issue 19 among them)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from _scenarios import SCENARIOS
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert "script" in SCENARIOS and "suite" in SCENARIOS
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Benchmarks"):]
    for name in SCENARIOS:
        assert f"| `{name}` |" in table, name
    proc = _run("--help")
    assert proc.returncode == 0 and "script" in proc.stdout


# -- issue 35: the busy, batch and xdist scenarios' parts (each scenario itself takes minutes)

@pytest.fixture()
def load_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import _load

        yield _load
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_hogs_are_stopped_on_leaving_the_block_even_on_an_error(load_module):
    with pytest.raises(RuntimeError):
        with load_module.hogs(2, 60) as procs:
            assert len(procs) == 2 and all(p.poll() is None for p in procs)
            raise RuntimeError("a run failed")
    assert all(p.poll() is not None for p in procs)


def test_a_hog_ends_by_itself_at_its_time_limit(load_module):
    with load_module.hogs(1, 0.3) as procs:
        assert procs[0].wait(timeout=30) == 0


def test_kill_job_finds_a_process_that_left_the_session_by_its_marker(load_module):
    """As kdb's store worker does: a grandchild that setsids and outlives its parent is still
    found by the job's environment variable, and killed."""
    token = load_module.new_token()
    env = {**os.environ, load_module.JOB_MARKER: token}
    code = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)'], start_new_session=True)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=30)
    assert len(load_module.job_processes(load_module.JOB_MARKER, token)) == 1
    killed = load_module.kill_job(load_module.JOB_MARKER, token)
    assert len(killed) == 1 and "time.sleep(60)" in next(iter(killed.values()))
    assert load_module.job_processes(load_module.JOB_MARKER, token) == []


def test_an_orphaned_grandchilds_cpu_time_is_counted_once_it_is_reaped(tmp_path):
    """The busy scenario counts the store worker's CPU time: a grandchild that left the
    session and outlived its parent (as kdb's worker does) is reparented to the benchmark,
    its subreaper, and its CPU time counted as it is reaped."""
    script = tmp_path / "reaper.py"
    script.write_text(f"""
import subprocess, sys, time
sys.path.insert(0, {str(REPO / "benchmarks")!r})
import _load
assert _load.adopt_orphans()
burn = "import time; t = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"
subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen("
                "[sys.executable, '-c', sys.argv[1]], start_new_session=True)", burn],
               check=True)
print(round(_load.reap_orphans(), 2))
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) >= 0.3, proc.stdout


def test_worker_kind_names_what_kdb_starts(load_module):
    kind = load_module.worker_kind
    assert kind("python -m kdb.worker /c/v1/spool/ab") == "worker"
    assert kind("python -m kdb.worker --child") == "lane"
    assert kind("python -m kdb.worker --slow-child") == "lane"
    assert kind("python -m kdb.worker --ahead /s 1") == "ahead"
    assert kind("python _rank_workload.py array 0") == "job"


def test_the_xdist_client_suite_collects(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", str(REPO / "benchmarks" / "xdist_suite")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "XDIST_SCALE": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 tests collected" in proc.stdout
