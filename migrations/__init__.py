"""Alembic environment of kdb's databases; ships inside the wheel as ``kdb.migrations``."""
