"""``python -m kdb.worker``: the store worker under its documented name (it lives in
:mod:`kdb.storing.worker`)."""

import sys

from kdb.storing.worker import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
