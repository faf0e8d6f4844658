"""``kdb shared``: the shared tier's administration. ``init --tenant NAME`` prints the SQL
that gives a tenant its own schema and role on the server (:mod:`kdb.shared.tenants`), or runs
it over an administrator's URL (``--apply``)."""

from __future__ import annotations

import click


@click.group()
def shared() -> None:
    """The shared tier (KDB_SHARED_URL): setting up its server.

    \b
    Example:
        kdb shared init --tenant vision
    """


@shared.command()
@click.option("--tenant", required=True, metavar="NAME",
              help="The namespace (KDB_SHARED_NAMESPACE): a lower-case letter, then at most 39 "
                   "lower-case letters, digits or '_'.")
@click.option("--role", default=None, help="The tenant's login role (default: kdb_NAME).")
@click.option("--apply", "admin_url", default=None, metavar="URL",
              help="Run the SQL over this URL of a superuser (or of a role that may create "
                   "roles and schemas) instead of printing it.")
def init(tenant: str, role: str | None, admin_url: str | None) -> None:
    """Give a tenant a schema (kdb_NAME) and a role of its own on the shared server.

    Prints SQL for a superuser to run once per tenant and database (psql reads it as it is):
    the role, its schema, no privilege on the schema for anyone else, and no tables in
    public for anyone. The server then keeps tenants apart: one tenant's credentials cannot
    read or write another's kernels, compile log, counters or cap, whatever SQL they send.
    Then the tenant's nodes set the two variables it prints last.

    \b
    Example:
        kdb shared init --tenant vision | psql -U postgres -d kdb
        kdb shared init --tenant vision --apply postgresql://postgres@db/kdb
    """
    from ..errors import InvalidArgumentError
    from ..shared import tenants

    try:
        _, _, role = tenants.names(tenant, role)
    except InvalidArgumentError as err:  # a usage error (status 2), before anything runs
        raise click.BadParameter(str(err)) from None
    statements = tenants.init_sql(tenant, role)
    if admin_url is None:
        click.echo(f"-- kdb shared init --tenant {tenant}: run once as a superuser, in the "
                   "database of KDB_SHARED_URL")
        for statement in statements:
            click.echo(statement + ";")
    else:
        done = tenants.apply(admin_url, tenant, role)
        click.echo(f"-- ran on {tenants.pgserver.mask(admin_url)}:")
        for statement in done:
            click.echo(statement + ";")
        for statement in statements:
            if statement not in done:
                click.echo(f"-- kept what exists: {statement}")
    click.echo(f"-- then give the role a password (psql: \\password {role}), put it in the "
               "nodes' ~/.pgpass\n-- (or PGPASSWORD), and set on the tenant's nodes:")
    click.echo("--   " + tenants.client_settings(tenant, role, admin_url))
