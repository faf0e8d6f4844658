"""kdb's version, written once: the package metadata (``pyproject.toml`` reads it from here),
``kdb.__version__`` and every file kdb writes take it from this module."""

__version__ = "0.1.0"
