"""Data-only package of a fake system kernel database (tests/test_discovery.py).

kdb must find ``<arch>.kdb`` in this directory without importing the package: an import
leaves a marker file for the test to see, then fails.
"""

import os

_marker = os.environ.get("KDB_TEST_IMPORT_MARKER")
if _marker:
    with open(_marker, "w") as _f:
        _f.write("imported\n")
raise ImportError("kdb imported kdb_system_fake: system databases must be found without import")
