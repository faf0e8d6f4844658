"""The compiler-free key of each entry, so a process with no compiler can be served.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""
from alembic import op
import sqlalchemy as sa

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_kernels = sa.table("kernels", sa.column("key", sa.Text), sa.column("attributes", sa.Text),
                    sa.column("compiler_free_key", sa.Text))


def upgrade() -> None:
    from kdb.keys import compiler_free_key

    with op.batch_alter_table("kernels") as batch:
        batch.add_column(sa.Column("compiler_free_key", sa.Text, nullable=True))
        batch.create_index("ix_kernels_compiler_free_key", ["compiler_free_key"])
    bind = op.get_bind()
    rows = bind.execute(sa.select(_kernels.c.key, _kernels.c.attributes)).all()
    for key, attributes in rows:
        free = compiler_free_key(attributes)
        if free is not None:
            bind.execute(_kernels.update().where(_kernels.c.key == key)
                         .values(compiler_free_key=free))


def downgrade() -> None:
    with op.batch_alter_table("kernels") as batch:
        batch.drop_index("ix_kernels_compiler_free_key")
        batch.drop_column("compiler_free_key")
