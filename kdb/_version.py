"""kdb's version, written once: pyproject.toml reads it from here, ``kdb.__version__`` names
it, and every file kdb writes records it. A leaf: it imports nothing, so any layer may."""

__version__ = "0.1.0"
