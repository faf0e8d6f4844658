"""The schema's one definition (SQLAlchemy Core), used by alembic and by ``kdb pack``.

The hot path reads these tables with plain :mod:`sqlite3` (importing SQLAlchemy costs
0.2-0.3 s); the column names below are the contract between the two, pinned by a test.
"""

from __future__ import annotations

from sqlalchemy import Column, Float, Index, Integer, LargeBinary, MetaData, Table, Text

metadata = MetaData()

#: One row per compiled binary. The canonical JSON of the hash attributes (the key's input)
#: is stored compressed with its source cut out into ``sources`` (revision 0006,
#: :mod:`kdb.file.compact`; before, whole in a text column ``attributes``); a hit compares
#: ``attributes_sha256`` with its key. ``details`` holds machine-local facts (device name,
#: driver, paths) that must never enter the key.
kernels = Table(
    "kernels",
    metadata,
    Column("key", Text, primary_key=True),
    Column("arch", Text, nullable=False),
    Column("backend", Text, nullable=False),
    Column("name", Text, nullable=False, server_default=""),
    Column("details", Text, nullable=False, server_default="{}"),
    Column("codec", Text, nullable=False),
    Column("dict_id", Integer, nullable=True),
    Column("blob", LargeBinary, nullable=False),
    Column("raw_size", Integer, nullable=False),
    Column("stored_size", Integer, nullable=False),
    Column("checksum", Text, nullable=False),
    Column("compile_seconds", Float, nullable=False, server_default="0"),
    Column("created", Float, nullable=False),
    Column("last_access", Float, nullable=False),
    Column("hits", Integer, nullable=False, server_default="0"),
    # The key with the compiler identity left out (revision 0004): where no compiler is
    # installed, kdb.backends.fallback finds the entries built for everything else a lookup asked.
    Column("compiler_free_key", Text, nullable=True),
    # Who vouched for the entry (revision 0005, kdb.signing): the signer's key id and an
    # Ed25519 signature over the key, the attributes and the checksum; NULL when unsigned.
    Column("signer", Text, nullable=True),
    Column("signature", LargeBinary, nullable=True),
    # The attributes as stored (revision 0006, kdb.file.compact): ``attrs`` compressed with
    # the source's literal cut out, ``source`` the sha256 of that literal (its row in
    # ``sources``; NULL when nothing was cut out), ``attributes_sha256`` the sha256 of the
    # whole text, computed by the writer from what it stored (the hit's collision check).
    Column("attrs", LargeBinary, nullable=False),
    Column("source", Text, nullable=True),
    Column("attributes_sha256", Text, nullable=False),
    Index("ix_kernels_last_access", "last_access"),
    Index("ix_kernels_name", "name"),
    Index("ix_kernels_compiler_free_key", "compiler_free_key"),
    Index("ix_kernels_source", "source"),
)

#: Each source once (revision 0006): the JSON string literal of a program's source as it
#: appears in canonical attributes, keyed by its sha256, compressed (``size``: its bytes).
#: A row lives as long as an entry names it; whoever deletes entries deletes the sources
#: they leave unused (:func:`kdb.file.eviction.drop_unused_sources`).
sources = Table(
    "sources",
    metadata,
    Column("digest", Text, primary_key=True),
    Column("body", LargeBinary, nullable=False),
    Column("size", Integer, nullable=False),
)

#: Facts about the file: format version, arch, kdb version, running total of stored bytes.
meta = Table(
    "meta",
    metadata,
    Column("name", Text, primary_key=True),
    Column("value", Text, nullable=False),
)

#: One row per compile kdb performed: the start-up latency log (revision 0002).
compile_log = Table(
    "compile_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("key", Text, nullable=False),
    Column("name", Text, nullable=False, server_default=""),
    Column("arch", Text, nullable=False),
    Column("backend", Text, nullable=False, server_default=""),
    Column("seconds", Float, nullable=False),
    Column("missed", Text, nullable=False, server_default=""),
    Column("reason", Text, nullable=False, server_default=""),
    Column("pid", Integer, nullable=False, server_default="0"),
    Index("ix_compile_log_at", "at"),
)

#: Counters kept across processes: hits per tier, misses, compiles, seconds (revision 0002).
counters = Table(
    "counters",
    metadata,
    Column("name", Text, primary_key=True),
    Column("value", Float, nullable=False, server_default="0"),
)
