"""The ``kdb`` command line: thin commands over the library (open, call, print).

The commands live by concept in :mod:`kdb.cli.info`, :mod:`kdb.cli.report` (reads),
:mod:`kdb.cli.maintenance` (changes to the user tier), :mod:`kdb.cli.build` (demo, pack,
run) and :mod:`kdb.cli.shared` (the shared tier's server); this module is the group they
join and the entry point (``kdb.cli:main``). Every command reads the user tier from
``--cache-dir``, else ``KDB_CACHE_DIR``, else the platform's user cache; system databases
from ``KDB_SYSTEM_DB_PATH`` and installed packages. Library errors (:class:`kdb.KdbError`)
become one clean line and a non-zero exit, mapped in :class:`_Group` and nowhere else. The
top layer: it may import every other wing.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from typing import Any, Sequence

import click

from . import (
    build as cli_build,
    info as cli_info,
    keys as cli_keys,
    maintenance as cli_maintenance,
    report as cli_report,
    shared as cli_shared,
)
from .. import config
from ..file import compact
from .tools import Settings
from ..errors import KdbError
from .._version import __version__


class _Group(click.Group):
    """Maps library errors to clean messages (exit code 1, no traceback), in one place."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KdbError as err:
            raise click.ClickException(str(err)) from err
        except BrokenPipeError:
            raise
        except OSError as err:  # say what failed on which path, not the exception's class
            where = f": {err.filename}" if err.filename else ""
            raise click.ClickException(f"{err.strerror or err}{where}") from err
        except sqlite3.Error as err:
            compact.reraise_interrupt(err)  # Ctrl-C inside kdb's SQL function: "Aborted!"
            raise click.ClickException(f"{type(err).__name__}: {err}") from err
        except Exception as err:
            compact.reraise_interrupt(err)
            database = _database_error(err)
            if database is None:
                raise
            raise click.ClickException(database) from err


def _database_error(err: Exception) -> str | None:
    """SQLAlchemy's wrapper of a database error (alembic's migrations, ``kdb pack``'s system
    file: a full disk gave a traceback) as one line: the driver's message, no SQL; None for
    anything else. SQLAlchemy is not imported for this."""
    sa = sys.modules.get("sqlalchemy.exc")
    if sa is None or not isinstance(err, sa.DBAPIError):
        return None
    orig = err.orig
    return f"{type(orig).__name__}: {orig}" if orig is not None else str(err).split("\n")[0]


class _ConfigProblem(click.ClickException):
    """A ``KDB_*`` variable kdb cannot use: a usage error of the command line (status 2)."""

    exit_code = 2


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="User tier root (overrides KDB_CACHE_DIR).")
@click.version_option(__version__, prog_name="kdb")
@click.pass_context
def cli(ctx: click.Context, cache_dir: Path | None) -> None:
    """kdb: a database of compiled GPU kernel binaries.

    The user tier lives in <cache dir>/v1/<arch>.kdb (--cache-dir, else KDB_CACHE_DIR);
    read-only system databases come from KDB_SYSTEM_DB_PATH and installed packages.

    \b
    Example:
        kdb info
    """
    from ..file import entrypoints

    entrypoints.create_cache_dir = False  # a command reading a cache makes no directory
    bad = config.problems()
    if ctx.invoked_subcommand != "key":  # `kdb key gen` may make the key a variable names
        from ..signing.policy import problems as key_problems

        bad += key_problems()
    root = config.cache_root(cache_dir)
    if cache_dir is None and root.exists() and not root.is_dir():  # as --cache-dir FILE is
        bad.append(f"{config.ENV_CACHE_DIR}={str(root)!r} is not a directory: name the "
                   "directory kdb's user tier lives in")
    elif config.user_dir(cache_dir).exists() and not config.user_dir(cache_dir).is_dir():
        bad.append(f"{config.user_dir(cache_dir)}, the user tier's directory, is not a "
                   "directory: move that file away, or name another cache directory")
    if bad:  # a program warns and goes on; a command says so and does nothing (status 2)
        raise _ConfigProblem("\n".join(bad) + "\nfix or unset the variable(s) and run the "
                             "command again")
    ctx.obj = Settings(root, config.user_dir(cache_dir),
                       cache_dir is not None)


for _command in (cli_info.info, cli_report.ls_, cli_report.stats, cli_report.log_,
                 cli_report.explain, cli_maintenance.clear, cli_maintenance.verify,
                 cli_maintenance.evict, cli_maintenance.migrate_, cli_build.demo,
                 cli_build.pack_, cli_build.run_command, cli_keys.key, cli_shared.shared):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``kdb`` script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="kdb")


if __name__ == "__main__":  # pragma: no cover
    main()
