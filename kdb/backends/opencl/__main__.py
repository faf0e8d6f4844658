"""``python -m kdb.backends.opencl --read-binaries``: the helper a process that stores a PoCL
program itself hands the binary read to (:mod:`.readback`): it builds the programs named on
stdin and writes their binaries to stdout."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    auto_hook = sys.modules.get("_kdb_auto")  # KDB_AUTO=1 inherited: never adopt in here
    if auto_hook is not None:
        auto_hook.disable()
    if argv != ["--read-binaries"]:
        print(__doc__, file=sys.stderr)
        return 2
    from .readback import serve

    return serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
