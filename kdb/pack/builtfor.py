"""What a pack's entries are built for: the compilers and Pythons their keys name.

A system file's entries are served only where their compiler identity matches (torch's
version, Triton's, the Python), so a pack says so: its wheel's metadata names them, and a
pack of entries that load only into one Python (a back end registered ``per_python``:
torch.compile's) is tagged for that Python, so that pip installs it nowhere else and an
index can hold one wheel per Python under one name and version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import registry
from ..admin.tierfiles import has_column, read_rows, reading
from ..file import compact

__all__ = ["BuiltFor", "built_for"]


@dataclass(frozen=True)
class BuiltFor:
    """``identities``: each compiler identity's name (``torch``, ``python``) and the values
    the file's entries name, sorted. ``python``: the one Python (``cpython-311``) the
    entries of a per-Python back end name, else None."""

    identities: tuple[tuple[str, tuple[str, ...]], ...] = ()
    python: str | None = None

    def describe(self) -> str:
        """``torch 2.13.0+cpu, python cpython-311``; "" when the entries name none.

        >>> BuiltFor((("python", ("cpython-311",)), ("torch", ("2.13.0+cpu",)))).describe()
        'python cpython-311, torch 2.13.0+cpu'
        """
        return ", ".join(f"{name} {' or '.join(values)}" for name, values in self.identities)

    def python_tag(self) -> str:
        """The wheel's Python tag: ``cp311`` for a per-Python pack, else ``py3``.

        >>> BuiltFor(python="cpython-311").python_tag(), BuiltFor().python_tag()
        ('cp311', 'py3')
        """
        if self.python and self.python.startswith("cpython-"):
            return "cp" + self.python.removeprefix("cpython-")
        return "py3"

    def requires_python(self) -> str:
        """``Requires-Python`` for the wheel: the one Python minor a per-Python pack is for.

        >>> BuiltFor(python="cpython-312").requires_python(), BuiltFor().requires_python()
        ('==3.12.*', '>=3.8')
        """
        tag = self.python_tag()
        return f"=={tag[2]}.{tag[3:]}.*" if tag.startswith("cp") else ">=3.8"


def built_for(path: Path) -> BuiltFor:
    """What the entries of the system file ``path`` are built for (read, not trusted: a
    name that is not a string pair is ignored)."""
    per_python = {b.name for b in registry.backends() if b.per_python}
    seen: dict[str, set[str]] = {}
    pythons: set[str] = set()
    with reading(Path(path), "system") as conn:
        attributes, join = compact.columns(has_column(conn, "kernels", "attrs"))
        rows = read_rows(conn, f"SELECT backend, {attributes} FROM kernels{join}")
    for backend, text in rows:
        for name, value in _compiler(text):
            seen.setdefault(name, set()).add(value)
            if name == "python" and backend in per_python:
                pythons.add(value)
    python = next(iter(pythons)) if len(pythons) == 1 else None
    return BuiltFor(tuple((n, tuple(sorted(v))) for n, v in sorted(seen.items())), python)


def _compiler(text: str) -> list[tuple[str, str]]:
    """The compiler identity pairs of an entry's attributes text.

    >>> _compiler('{"compiler": [["torch", "2.13.0"], ["cxx", 1]]}'), _compiler("x")
    ([('torch', '2.13.0')], [])
    """
    try:
        pairs = json.loads(text).get("compiler") or []
    except (TypeError, ValueError, AttributeError):
        return []
    return [(p[0], p[1]) for p in pairs if isinstance(p, list) and len(p) == 2
            and isinstance(p[0], str) and isinstance(p[1], str) and p[0] in _NAMED]


#: The identity parts a pack names: the versions that decide whether an entry is served
#: (a C++ compiler's version line, or a driver's, is in the key but not worth a title).
_NAMED = ("torch", "triton", "python")
