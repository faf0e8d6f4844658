"""``python -m kdb.cli``: the command line, as the ``kdb`` script runs it."""

from kdb.cli import main

if __name__ == "__main__":
    main()
