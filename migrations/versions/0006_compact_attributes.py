"""Compact attributes: compressed, each source once (kdb.file.compact).

The whole-text ``attributes`` column gives way to ``attrs`` (compressed, the source's literal
cut out), ``source`` (that literal's sha256, its row in the new ``sources`` table) and
``attributes_sha256`` (of the whole text: the hit's collision check). Every entry is
rewritten, a few hundred at a time; the text each gives back is the text it had, byte for
byte, so keys and signatures stay valid.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""
from alembic import op
import sqlalchemy as sa

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: The indexes of ``kernels`` before this revision: (name, column).
_INDEXES = (("ix_kernels_last_access", "last_access"), ("ix_kernels_name", "name"),
            ("ix_kernels_compiler_free_key", "compiler_free_key"))
#: Entries read and rewritten per statement (bounds the memory of a large shared tier).
_CHUNK = 200

_kernels = sa.table("kernels", sa.column("key", sa.Text), sa.column("attributes", sa.Text),
                    sa.column("attrs", sa.LargeBinary), sa.column("source", sa.Text),
                    sa.column("attributes_sha256", sa.Text))
_sources = sa.table("sources", sa.column("digest", sa.Text), sa.column("body", sa.LargeBinary),
                    sa.column("size", sa.Integer))


def upgrade() -> None:
    op.create_table(
        "sources",
        sa.Column("digest", sa.Text, primary_key=True),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("size", sa.Integer, nullable=False),
    )
    # SQLite's batch mode copies the table and makes its indexes again in no fixed order; a
    # pack must be the same bytes every time, so they are made again here, in this order.
    for name, _ in _INDEXES:
        op.drop_index(name, table_name="kernels")
    with op.batch_alter_table("kernels") as batch:
        batch.add_column(sa.Column("attrs", sa.LargeBinary, nullable=True))
        batch.add_column(sa.Column("source", sa.Text, nullable=True))
        batch.add_column(sa.Column("attributes_sha256", sa.Text, nullable=True))
    _pack_every_entry(op.get_bind())
    with op.batch_alter_table("kernels") as batch:
        batch.alter_column("attrs", existing_type=sa.LargeBinary, nullable=False)
        batch.alter_column("attributes_sha256", existing_type=sa.Text, nullable=False)
        batch.drop_column("attributes")
    for name, column in (*_INDEXES, ("ix_kernels_source", "source")):
        op.create_index(name, "kernels", [column])


def _pack_every_entry(bind) -> None:
    from kdb.file import compact

    keys = [r[0] for r in bind.execute(sa.select(_kernels.c.key).order_by(_kernels.c.key))]
    stored: set[str] = set()
    for at in range(0, len(keys), _CHUNK):
        chunk = keys[at:at + _CHUNK]
        rows = bind.execute(sa.select(_kernels.c.key, _kernels.c.attributes)
                            .where(_kernels.c.key.in_(chunk))).all()
        for key, text in rows:
            if isinstance(text, (bytes, memoryview)):  # a damaged row: kept, and a miss
                text = bytes(text).decode("utf-8", "surrogateescape")
            packed = compact.pack(text if isinstance(text, str) else str(text))
            if packed.source is not None and packed.source not in stored:
                stored.add(packed.source)
                bind.execute(_sources.insert().values(digest=packed.source, body=packed.body,
                                                      size=packed.size))
            bind.execute(_kernels.update().where(_kernels.c.key == key).values(
                attrs=packed.attrs, source=packed.source,
                attributes_sha256=packed.sha256))


def downgrade() -> None:
    from kdb.file import compact

    with op.batch_alter_table("kernels") as batch:
        batch.add_column(sa.Column("attributes", sa.Text, nullable=True))
    bind = op.get_bind()
    rows = bind.execute(sa.select(_kernels.c.key, _kernels.c.attrs, _kernels.c.source,
                                  _sources.c.body)
                        .select_from(_kernels.outerjoin(
                            _sources, _sources.c.digest == _kernels.c.source))).all()
    for key, attrs, source, body in rows:
        text = compact.unpack(attrs, source, body)
        bind.execute(_kernels.update().where(_kernels.c.key == key)
                     .values(attributes=text if text is not None else ""))
    for name, _ in (*_INDEXES, ("ix_kernels_source", None)):
        op.drop_index(name, table_name="kernels")
    with op.batch_alter_table("kernels") as batch:
        batch.drop_column("attributes_sha256")
        batch.drop_column("source")
        batch.drop_column("attrs")
        batch.alter_column("attributes", existing_type=sa.Text, nullable=False)
    for name, column in _INDEXES:
        op.create_index(name, "kernels", [column])
    op.drop_table("sources")
