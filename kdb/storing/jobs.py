"""A deferred store as a typed, serialisable job, and the back end that redoes it.

A process that compiled hands the store to the store worker (:mod:`kdb.storing.spool`) as a job
file: what to build again (back-end data such as OpenCL's ``program``), the entries'
attributes and its start-up latency rows. The job names its back end by a short name; the
worker asks :func:`backend_module` for that back end (:mod:`kdb.registry`, those that
``stores_jobs``) and calls its ``rebuild_and_store(db, data)`` with the job's JSON data.
Core modules never import a back end: the registry says where they live. A second kind of job carries the bookkeeping an exiting
process left for a user file that does not exist yet; a third names stored entries whose
programs generated more code after their store (``refresh``: the back end's
``refresh_job(db, job)``, e.g. :mod:`kdb.backends.opencl.refresh`).
"""

from __future__ import annotations


STORE = "store"
BOOKKEEPING = "bookkeeping"
REFRESH = "refresh"

_FIELDS = ("kind", "backend", "seconds", "entries", "logs", "cache_dir", "claims_dir", "archs",
           "environment", "first")
#: What each field must be: a job that says otherwise is malformed (the worker sets it aside).
_TYPES = {"kind": (str,), "backend": (str,), "seconds": (int, float, type(None)),
          "entries": (list,), "logs": (list,), "cache_dir": (str,), "claims_dir": (str,),
          "archs": (dict,), "environment": (dict,), "first": (bool,)}

#: Variables a job's ``environment`` may not name: they choose the programs and libraries
#: the worker runs (the dynamic loader's, Python's, the OpenCL ICD loader's), or kdb's own
#: settings, not what a compiler makes (a spool's ``environment.json`` carries them).
_NOT_A_BUILD_VARIABLE = ("LD_", "DYLD_", "PYTHON", "PATH", "KDB_", "OCL_", "OPENCL_")


def _check_environment(env: dict) -> None:
    """A job's ``environment``: variable names (not those of :data:`_NOT_A_BUILD_VARIABLE`)
    to a ``str`` value, or ``None`` for unset."""
    for name, value in env.items():
        if (not isinstance(name, str) or not name.isidentifier() or not name.isascii()
                or name.startswith(_NOT_A_BUILD_VARIABLE)):
            raise ValueError(f"a store job's environment cannot name {name!r:.60}")
        if value is not None and (not isinstance(value, str) or "\0" in value):
            raise ValueError(f"a store job's {name} must be a str or null: {value!r:.60}")


class StoreJob:
    """One job: ``kind`` (:data:`STORE`, :data:`BOOKKEEPING` or :data:`REFRESH`), the
    ``backend`` that redoes it, its compile ``seconds``, ``entries`` (key, name, attributes,
    seconds, details and the back end's own fields), latency ``logs`` rows, the ``cache_dir``
    and ``claims_dir`` it belongs to, ``archs`` (bookkeeping: arch -> rows), ``environment``
    (every variable the entries' keys consider, to its value or ``None`` for unset: the
    worker rebuilds in a process that has exactly these), ``first`` (nothing stands in for
    its entries until it is stored, so the next process compiles them: the worker stores it
    before older jobs) and ``extra``: the back end's data (e.g. ``program``, or a refresh
    job's ``refresh``), carried as it is."""

    __slots__ = _FIELDS + ("extra",)

    def __init__(self, kind: str = STORE, backend: str = "", seconds: float = 0.0, *,
                 entries: list | None = None, logs: list | None = None, cache_dir: str = "",
                 claims_dir: str = "", archs: dict | None = None,
                 environment: dict | None = None, first: bool = False,
                 extra: dict | None = None) -> None:
        self.kind = kind
        self.backend = backend
        self.seconds = float(seconds or 0.0)
        self.entries = list(entries or [])
        self.logs = list(logs or [])
        self.cache_dir = cache_dir
        self.claims_dir = claims_dir
        self.archs = dict(archs or {})
        self.environment = dict(environment or {})
        self.first = bool(first)
        self.extra = dict(extra or {})

    def __repr__(self) -> str:
        return f"StoreJob({self.kind!r}, backend={self.backend!r}, {len(self.entries)} entries)"

    @classmethod
    def bookkeeping(cls, cache_dir: str, archs: dict[str, dict]) -> StoreJob:
        """Bookkeeping (:meth:`kdb.bookkeeping.Book.take_json`) for the worker to write."""
        return cls(kind=BOOKKEEPING, cache_dir=cache_dir, archs=archs)

    @property
    def keys(self) -> list[str]:
        return [e.get("key", "") for e in self.entries]

    def to_dict(self) -> dict:
        """The job's JSON data (what a back end's ``rebuild_and_store`` receives)."""
        if self.kind == BOOKKEEPING:
            return {"kind": self.kind, "cache_dir": self.cache_dir, "archs": self.archs}
        data = {**self.extra, "kind": self.kind, "backend": self.backend,
                "seconds": self.seconds, "entries": self.entries, "logs": self.logs,
                "cache_dir": self.cache_dir, "claims_dir": self.claims_dir}
        if self.environment:
            data["environment"] = self.environment
        if self.first:
            data["first"] = True
        return data

    @classmethod
    def from_dict(cls, data: dict) -> StoreJob:
        """A job from its JSON data; fields kdb does not know are the back end's."""
        if not isinstance(data, dict):
            raise ValueError(f"a store job is a JSON object, not {type(data).__name__}")
        known = {k: data[k] for k in _FIELDS if k in data}
        for name, types in _TYPES.items():
            if name in known and not isinstance(known[name], types) or (
                    name == "seconds" and isinstance(known.get(name), bool)):
                raise ValueError(f"a store job's {name!r} cannot be a "
                                 f"{type(known[name]).__name__}: {known[name]!r:.60}")
        for e in known.get("entries", ()):
            if not isinstance(e, dict) or not isinstance(e.get("key", ""), str):
                raise ValueError(f"a store job's entry is not an object with a str key: {e!r:.60}")
            seconds = e.get("seconds", 0.0)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
                raise ValueError(f"a store job's entry has seconds {seconds!r:.60}, not a number")
        _check_environment(known.get("environment", {}))
        extra = {k: v for k, v in data.items() if k not in _FIELDS}
        return cls(**known, extra=extra)

    def to_json(self) -> str:
        import json  # a miss's: `import kdb.opencl` does not load json (docs/figures.md)

        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StoreJob:
        import json

        return cls.from_dict(json.loads(text))


def job_backends() -> list[str]:
    """The back ends whose deferred stores the store worker redoes (:mod:`kdb.registry`)."""
    from .. import registry

    return [b.name for b in registry.backends() if b.stores_jobs]


def backend_module(name: str):
    """The module of back end ``name``, one that stores jobs; ``LookupError`` if unknown."""
    import importlib

    from .. import registry

    try:
        entry = registry.get(name)
    except LookupError:
        entry = None
    if entry is None or not entry.stores_jobs:
        raise LookupError(f"a store job names an unknown back end {name!r}")
    return importlib.import_module(entry.module)
