"""Installs ``kdb-auto.pth`` beside kdb in site-packages; everything else is in pyproject.toml.

setuptools installs no top-level ``.pth`` from package data, so ``build_py`` writes it: into
the build directory for a wheel, and into the editable wheel for ``pip install -e``. The
line runs at every interpreter start; with ``KDB_AUTO`` unset or empty it costs one
environment lookup. Otherwise ``_kdb_auto.start()`` decides (see ``_kdb_auto.py``), and an
import that fails costs one line on stderr, never the program.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "kdb-auto.pth"
# What the line runs when KDB_AUTO is set (to anything; _kdb_auto.start() reads the value).
# Once per process: Python 3.11's site reads a venv's .pth files twice, and a failed import
# is not cached. The part site compiles at every start is kept short: compiling it is most
# of the line's cost (~28 us; the string literal is one token).
_START = """import sys
if '_kdb_auto' not in sys.modules:
 try:
  import _kdb_auto
  _kdb_auto.start()
 except Exception as e:
  sys.modules['_kdb_auto'] = None
  sys.stderr.write('kdb: KDB_AUTO is set but kdb cannot start (%s: %s); running without it\\n'
                   % (type(e).__name__, e))"""
PTH_LINE = "import os; os.environ.get('KDB_AUTO') and exec(%r)\n" % _START


class build_py_with_pth(build_py):  # noqa: N801 - setuptools' command naming
    def run(self):
        if not getattr(self, "editable_mode", False):
            # build/lib outlives a checkout's changes: a module moved or deleted since the
            # last build would ship in the wheel beside its new self.
            shutil.rmtree(os.path.join(self.build_lib, "kdb"), ignore_errors=True)
        super().run()
        targets = [self.build_lib]
        if getattr(self, "editable_mode", False):
            # An editable wheel is made of what `install` would put in site-packages; the
            # build directory is thrown away (setuptools' editable_wheel, PEP 660).
            targets = [self.get_finalized_command("install").install_lib]
        for directory in targets:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, PTH_NAME), "w", encoding="utf-8") as f:
                f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH_NAME)]


setup(cmdclass={"build_py": build_py_with_pth})
