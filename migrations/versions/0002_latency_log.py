"""Start-up latency log, counters, and machine-local details beside each entry.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""
from alembic import op
import sqlalchemy as sa

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("kernels") as batch:
        batch.add_column(sa.Column("details", sa.Text, nullable=False, server_default="{}"))
        batch.create_index("ix_kernels_name", ["name"])
    op.create_table(
        "compile_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False, server_default=""),
        sa.Column("arch", sa.Text, nullable=False),
        sa.Column("backend", sa.Text, nullable=False, server_default=""),
        sa.Column("seconds", sa.Float, nullable=False),
        sa.Column("missed", sa.Text, nullable=False, server_default=""),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
        sa.Column("pid", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_index("ix_compile_log_at", "compile_log", ["at"])
    op.create_table(
        "counters",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("value", sa.Float, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("counters")
    op.drop_index("ix_compile_log_at", "compile_log")
    op.drop_table("compile_log")
    with op.batch_alter_table("kernels") as batch:
        batch.drop_index("ix_kernels_name")
        batch.drop_column("details")
