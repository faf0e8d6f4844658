"""Tenants on one shared server: the SQL an administrator runs for one (``kdb shared init
--tenant NAME``), and running it over an administrator's URL (``--apply``).

A tenant is a schema ``kdb_<name>`` owned by a LOGIN role of its own. Nobody else holds any
privilege on that schema and nobody may create objects in ``public``, so another tenant's
credentials cannot read or write its rows, whatever SQL they send: the server keeps tenants
apart, not kdb. kdb connects with the schema as its whole search path
(:func:`kdb.shared.server.create_engine`), so the tables, alembic's version table, the
counters, the compile log and the cap are the tenant's; its advisory locks are salted with
the namespace (:func:`kdb.shared.server.lock_id`).
"""

from __future__ import annotations

import re

from sqlalchemy import text

from .. import config
from ..errors import InvalidArgumentError, KdbError
from . import server as pgserver
from .server import schema_name

#: A role name written without quotes (PostgreSQL folds unquoted names to lower case).
_ROLE = re.compile(r"[a-z_][a-z0-9_]{0,62}\Z")


def names(namespace: str, role: str | None = None) -> tuple[str, str, str]:
    """``(namespace, schema, role)`` checked; :class:`InvalidArgumentError` for a bad one."""
    try:
        ns = config.parse_namespace(namespace)
    except KdbError:
        ns = None
    if ns is None:
        raise InvalidArgumentError(f"tenant {namespace!r} is not a namespace name: use a "
                                   "lower-case letter, then at most 39 lower-case letters, "
                                   "digits or '_'")
    schema = schema_name(ns)
    role = schema if role is None else role
    if not _ROLE.match(role):
        raise InvalidArgumentError(f"role {role!r} is not a plain role name: use lower-case "
                                   "letters, digits and '_', at most 63")
    return ns, schema, role


def init_sql(namespace: str, role: str | None = None) -> list[str]:
    """The statements a superuser runs once for a tenant (without their ``;``)."""
    _, schema, role = names(namespace, role)
    return [f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE",
            f"CREATE SCHEMA {schema} AUTHORIZATION {role}",
            f"REVOKE ALL ON SCHEMA {schema} FROM PUBLIC",
            # PostgreSQL before 15 lets every role create tables in public: a tenant's
            # tables there would be outside its schema (and kdb would never use them).
            "REVOKE CREATE ON SCHEMA public FROM PUBLIC"]


def client_settings(namespace: str, role: str | None = None, url: str | None = None) -> str:
    """The tenant's nodes' variables: the URL (as ``role``, no password: it goes in
    ``~/.pgpass`` or ``PGPASSWORD``) and the namespace. ``url`` gives host and database."""
    ns, _, role = names(namespace, role)
    where = "HOST:5432/DATABASE"
    if url is not None:
        from sqlalchemy.engine import make_url

        try:
            u = make_url(url)
            where = f"{u.host or 'HOST'}:{u.port or 5432}/{u.database or 'DATABASE'}"
        except Exception:  # noqa: BLE001 - unparsable: the placeholders say what to fill in
            pass
    return (f"{config.ENV_SHARED_URL}=postgresql+psycopg://{role}@{where} "
            f"{config.ENV_SHARED_NAMESPACE}={ns}")


def _check_reused(shown: str, role: str, schema: str, *, powerful: bool,
                  others: list[str]) -> None:
    """An existing role given to a tenant is kept as it is: refused where its credentials
    on the tenant's nodes would reach past the tenant (a superuser, one that creates roles
    or bypasses row security: an administrator's; one owning another tenant's schema: that
    tenant's rows too). ``--role postgres`` was taken, and printed as NOSUPERUSER."""
    if powerful:
        why = ("is a superuser, or may create roles or bypass row security: its credentials "
               "are an administrator's, and docs/shared.md keeps those off the nodes")
    elif others:
        why = (f"owns {', '.join(others)}: the tenant's nodes would read and write those "
               "tenants' rows too")
    else:
        return
    raise KdbError(f"{shown}: the role {role} {why}. Give the tenant a role of its own "
                   f"(--role, a name no role has yet) for {schema}; nothing was changed")


def apply(url: str, namespace: str, role: str | None = None) -> list[str]:
    """Run :func:`init_sql` over an administrator's ``url`` in one transaction; returns the
    statements run. A role or schema that exists is kept (the schema only if ``role`` owns
    it). Raises :class:`KdbError`, the URL's password masked, when the server refuses."""
    _, schema, role = names(namespace, role)
    shown = pgserver.mask(url)
    engine = pgserver.create_engine(url)
    done = []
    try:
        with pgserver.watchdog.guard(pgserver.bound_s(8)), engine.begin() as conn:
            found = conn.execute(text(
                "SELECT rolsuper OR rolcreaterole OR rolbypassrls, ARRAY(SELECT nspname "
                "FROM pg_namespace WHERE nspowner = r.oid AND nspname LIKE 'kdb\\_%' "
                "AND nspname <> :s ORDER BY nspname) FROM pg_roles AS r WHERE rolname = :r"),
                {"r": role, "s": schema}).first()
            has_role = found is not None
            owner = conn.execute(text("SELECT pg_get_userbyid(nspowner) FROM pg_namespace "
                                      "WHERE nspname = :s"), {"s": schema}).scalar()
            if owner not in (None, role):
                raise KdbError(f"{shown}: the schema {schema} exists and belongs to {owner}, "
                               f"not {role}; nothing was changed")
            if has_role:
                _check_reused(shown, role, schema, powerful=found[0], others=list(found[1]))
            for statement in init_sql(namespace, role):
                if ((statement.startswith("CREATE ROLE") and has_role)
                        or (statement.startswith("CREATE SCHEMA") and owner == role)):
                    continue
                conn.exec_driver_sql(statement)
                done.append(statement)
    except KdbError:
        raise
    except Exception as err:  # noqa: BLE001 - refused, unreachable: say so, no secrets
        raise KdbError(f"{shown}: {pgserver.scrub(pgserver.reason(err), url)}"
                       "; nothing was changed") from None
    finally:
        engine.dispose()
    return done
