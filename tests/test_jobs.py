"""kdb.storing.jobs: a deferred store is a typed job that survives JSON and names its back end."""

from __future__ import annotations

import pytest

from kdb.storing import jobs
from kdb.storing.jobs import BOOKKEEPING, STORE, StoreJob


def test_a_store_job_round_trips_through_json_with_the_back_ends_own_fields():
    data = {"kind": "store", "backend": "opencl", "seconds": 0.5,
            "program": {"source": "__kernel void k() {}", "options": ""},
            "entries": [{"key": "ab", "name": "k", "attributes": "{}", "seconds": 0.5,
                         "details": {}, "device": 0}],
            "logs": [["row"]], "cache_dir": "/c", "claims_dir": "/c/v1/claims"}
    job = StoreJob.from_json(StoreJob.from_dict(data).to_json())
    assert job.kind == STORE and job.backend == "opencl" and job.seconds == 0.5
    assert job.keys == ["ab"]
    assert job.extra == {"program": data["program"]}
    assert job.to_dict() == data  # what the back end's rebuild_and_store receives, unchanged


def test_a_job_carries_its_build_variables_and_never_what_starts_programs():
    data = {"kind": "store", "backend": "opencl", "entries": [],
            "environment": {"POCL_EXTRA_BUILD_FLAGS": "-DN=2", "AMD_OCL_BUILD_OPTIONS": None}}
    job = StoreJob.from_json(StoreJob.from_dict(data).to_json())
    assert job.environment == data["environment"] and "environment" not in job.extra
    for name in ("LD_PRELOAD", "PYTHONPATH", "PATH", "KDB_CACHE_DIR", "OCL_ICD_VENDORS",
                 "OPENCL_VENDOR_PATH", "A=B", "", 3):
        with pytest.raises(ValueError, match="environment cannot name"):
            StoreJob.from_dict({**data, "environment": {name: "x"}})
    with pytest.raises(ValueError, match="must be a str or null"):
        StoreJob.from_dict({**data, "environment": {"IGC_ExtraOCLOptions": 1}})


def test_a_bookkeeping_job_carries_only_its_rows():
    job = StoreJob.bookkeeping("/c", {"arch": {"logs": [], "hits": {}, "counters": {"x": 1}}})
    assert job.to_dict() == {"kind": BOOKKEEPING, "cache_dir": "/c",
                             "archs": {"arch": {"logs": [], "hits": {}, "counters": {"x": 1}}}}
    assert StoreJob.from_dict(job.to_dict()).archs == job.archs


def test_the_registry_names_each_back_end_and_refuses_an_unknown_one():
    assert jobs.job_backends() == ["opencl"]  # the one whose stores the worker redoes
    assert jobs.backend_module("opencl").__name__ == "kdb.backends.opencl"
    for name in ("nosuch", "cuda"):  # unknown, or one that hands the worker no jobs
        with pytest.raises(LookupError, match="unknown back end"):
            jobs.backend_module(name)


def test_a_job_that_is_not_an_object_is_refused():
    with pytest.raises(ValueError):
        StoreJob.from_dict(["not", "a", "job"])


@pytest.mark.parametrize("data", [{"seconds": "x"}, {"seconds": True}, {"entries": [1]},
                                  {"entries": [{"key": 1}]}, {"entries": {}}, {"logs": "x"},
                                  {"cache_dir": 3}])
def test_a_job_whose_fields_have_the_wrong_types_is_refused(data):
    """The worker sets such a job aside (test_worker) instead of crashing on it."""
    with pytest.raises(ValueError, match="store job"):
        StoreJob.from_dict(data)
