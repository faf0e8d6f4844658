#!/usr/bin/env bash
# Make PostgreSQL's server binaries (initdb, pg_ctl, postgres) available for the shared-tier
# tests (tests/test_shared.py starts a throw-away server on 127.0.0.1 with them). `make test`
# runs this first, so the README's test command works on a fresh Debian/Ubuntu machine.
#
# Installs Debian's `postgresql` package only when initdb is absent and this runs as root
# with apt-get (CI); otherwise it says why and the PostgreSQL tests skip with that reason.
# It never fails the build.
set -uo pipefail

# The same places tests/test_shared.py looks (PG_BIN_GLOBS): PATH, then the versioned bin
# dirs of Debian/Ubuntu, of the PGDG packages (RHEL/Fedora), and of a source build.
have_initdb() {
    command -v initdb >/dev/null 2>&1 && return 0
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && return 0
    compgen -G "/usr/pgsql-*/bin/initdb" >/dev/null && return 0
    [ -x /usr/local/pgsql/bin/initdb ]
}

have_initdb && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_postgres: installing the PostgreSQL server (apt-get install postgresql)" \
         "for the shared-tier tests"
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql \
            >/dev/null && have_initdb; then
        exit 0
    fi
    echo "ensure_postgres: installing postgresql failed; tests/test_shared.py will skip" >&2
else
    echo "ensure_postgres: no PostgreSQL server binaries (initdb) here, and installing them" \
         "needs root and apt-get; tests/test_shared.py will skip." \
         "Install them with: sudo apt-get install postgresql" >&2
fi
exit 0
