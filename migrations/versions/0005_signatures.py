"""Signed entries: the signer's key id and the signature beside each entry (kdb.signing).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""
from alembic import op
import sqlalchemy as sa

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable columns added at the end: SQLite adds them in place, no table copy.
    op.add_column("kernels", sa.Column("signer", sa.Text, nullable=True))
    op.add_column("kernels", sa.Column("signature", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("kernels") as batch:
        batch.drop_column("signature")
        batch.drop_column("signer")
