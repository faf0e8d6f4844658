"""Running totals of entries and raw bytes in ``meta``, so stats never scan.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""
from alembic import op
import sqlalchemy as sa

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_meta = sa.table("meta", sa.column("name", sa.Text), sa.column("value", sa.Text))
_kernels = sa.table("kernels", sa.column("raw_size", sa.Integer),
                    sa.column("stored_size", sa.Integer))
_TOTALS = ("entries", "raw_bytes", "stored_bytes")


def upgrade() -> None:
    bind = op.get_bind()
    count, raw, stored = bind.execute(sa.select(
        sa.func.count(),
        sa.func.coalesce(sa.func.sum(_kernels.c.raw_size), 0),
        sa.func.coalesce(sa.func.sum(_kernels.c.stored_size), 0),
    )).one()
    op.execute(_meta.delete().where(_meta.c.name.in_(_TOTALS)))
    op.bulk_insert(_meta, [{"name": "entries", "value": str(count)},
                           {"name": "raw_bytes", "value": str(raw)},
                           {"name": "stored_bytes", "value": str(stored)}])


def downgrade() -> None:
    op.execute(_meta.delete().where(_meta.c.name.in_(("entries", "raw_bytes"))))
