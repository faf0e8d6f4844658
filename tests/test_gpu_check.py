"""The GPU check's CPU half (benchmarks/gpu/check.py --no-gpu --quick), so that the half that
needs a GPU is not first tried on the device machine: what travels fits the device's limits
(64 MiB with the working tree, a command under 2,000 characters), kdb installs from the
carried wheels alone, and the dry run of the GPU half's steps that need no GPU passes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton", reason="Triton is not installed (pip install 'kdb[triton]')")
pytestmark = pytest.mark.slow  # builds a wheel, downloads wheels, compiles: ~45 s


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "check.py"),
                           "--no-gpu", "--quick", "--carry", str(tmp / "carry"), "--work",
                           str(tmp / "work")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return tmp / "carry", proc.stdout, json.loads((tmp / "carry" / "gpu-check.json").read_text())


def test_what_travels_fits_the_device_machine(prepared):
    carry, stdout, data = prepared
    travels = data["parts"]["prepare"]["figures"]["travels"]
    assert travels["total_bytes"] < 64 * 2**20 and travels["fits"]
    assert travels["command_chars"] < 2000 and travels["command"] in stdout
    assert (carry / "command.txt").read_text().strip() == travels["command"]
    wheels = [p.name for p in (carry / "wheels").iterdir()]
    assert any(w.startswith("kdb-") for w in wheels)
    assert not any(w.startswith("numpy-") for w in wheels)  # the machine has it
    assert [p.name for p in (carry / "packs").iterdir()] == [
        f"kdb_system_sm_90-1.0.0-cp{sys.version_info[0]}{sys.version_info[1]}-none-any.whl"]


def test_the_dry_run_installs_from_the_carried_wheels_and_serves_without_a_gpu(prepared):
    _, _, data = prepared
    dry = data["parts"]["dry run"]
    assert dry["status"] == "pass", dry
    fig = dry["figures"]
    assert fig["install"]["from_the_wheel"] and fig["install"]["bare_sees_no_compiler_packages"]
    assert fig["triton_sm_90"]["compiles"][0] > 0 and fig["triton_sm_90"]["compiles"][1] == 0
    assert fig["triton_sm_90"]["binaries_equal"]
    served = fig["pack_served_without_compiler"]
    assert served["compiler_here"].startswith("none") and served["kdb"] == {"hits.system": 1}
    keys = fig["pack_keys_are_launch_keys"]  # a pack that launches would not find is no pack
    assert keys["compiles"] == 0 and keys["kdb"] == {"hits.system": 3}
    if shutil.which("hipcc"):  # the hip part's steps that need no GPU
        hip = fig["hip"]
        assert hip["kdb"][0]["compiles"] == 1 and not hip["kdb"][1].get("compiles"), hip
        assert hip["same_code_object"] and hip["ok"] == [{"target": True}] * 2


def test_every_gpu_part_says_it_was_not_run(prepared):
    _, stdout, data = prepared
    for name in ("triton", "cuda", "pycuda", "pack", "inductor", "opencl", "timing"):
        assert data["parts"][name] == {"status": "skipped", "reason": "not run: no GPU"}
    assert data["parts"]["hip"] == {"status": "skipped",
                                    "reason": "no AMD GPU (not run: no GPU)"}
    assert data["verdict"].startswith("kdb GPU check: PREPARED, GPU half not run: no GPU")
    assert data["verdict"] in stdout


def test_kdbs_wheel_builds_from_a_venv_whose_setuptools_predates_pep_639(tmp_path):
    """The check's first step builds kdb's wheel; in a venv whose setuptools cannot read
    pyproject's license string (before 77) it builds in pip's isolated environment instead
    of failing ("project.license must be valid exactly by one definition")."""
    import venv

    venv.create(tmp_path / "v", with_pip=True)
    py = str(tmp_path / "v" / "bin" / "python")
    got = subprocess.run([py, "-m", "pip", "install", "--quiet", "setuptools==68.0.0"],
                         capture_output=True, text=True, timeout=300)
    if got.returncode != 0:
        pytest.skip(f"setuptools 68 cannot be installed here: {got.stderr[-300:]}")
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "import check; print(check.isolation(check._setuptools_version())); "
            "print(check.build_kdb_wheel(Path(sys.argv[2])).name)")
    proc = subprocess.run([py, "-c", code, str(REPO / "benchmarks" / "gpu"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags, wheel = proc.stdout.split("\n")[:2]
    assert flags == "[]" and wheel.startswith("kdb-") and wheel.endswith(".whl")
