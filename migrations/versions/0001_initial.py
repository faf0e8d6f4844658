"""Initial schema: kernels and meta.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""
from alembic import op
import sqlalchemy as sa

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kernels",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("arch", sa.Text, nullable=False),
        sa.Column("backend", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False, server_default=""),
        sa.Column("attributes", sa.Text, nullable=False),
        sa.Column("codec", sa.Text, nullable=False),
        sa.Column("dict_id", sa.Integer, nullable=True),
        sa.Column("blob", sa.LargeBinary, nullable=False),
        sa.Column("raw_size", sa.Integer, nullable=False),
        sa.Column("stored_size", sa.Integer, nullable=False),
        sa.Column("checksum", sa.Text, nullable=False),
        sa.Column("compile_seconds", sa.Float, nullable=False, server_default="0"),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("last_access", sa.Float, nullable=False),
        sa.Column("hits", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_index("ix_kernels_last_access", "kernels", ["last_access"])
    op.create_table(
        "meta",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("meta")
    op.drop_index("ix_kernels_last_access", "kernels")
    op.drop_table("kernels")
