"""The hash attributes: everything that determines a binary, and the key derived from them.

A key is the sha256 of a canonical, versioned JSON encoding (sorted keys, explicit type tags,
no pickle). Nothing machine-local belongs here: paths, mtimes, host and device marketing names
go into the entry's metadata instead, so a system database built on one machine hits on
every other machine with the same arch and compiler.
"""

from __future__ import annotations

import sys

from collections.abc import Mapping

# hashlib loads OpenSSL (3-4 ms) and json its decoder and scanner (1.5 ms), in every process
# that asks for a key: the builtin sha256 and json's C string encoder give the same bytes,
# and keep `import kdb.opencl` after pyopencl within its figure (docs/figures.md).
try:
    from _sha256 import sha256  # CPython <= 3.11
except ImportError:  # pragma: no cover - depends on the Python version
    try:
        from _sha2 import sha256  # CPython >= 3.12
    except ImportError:
        from hashlib import sha256
try:
    from _json import encode_basestring as _quote
except ImportError:  # pragma: no cover - Pythons without json's C accelerator
    from json.encoder import py_encode_basestring as _quote

from .config import check_arch
from .errors import InvalidArgumentError, KdbError, UnsupportedTypeError


TYPE_CHECKING = False  # `import kdb` loads this module, and no typing (a hit does)
if TYPE_CHECKING:  # annotations are strings here
    from typing import Any, Iterable

#: Bump when the encoding below changes: every key changes with it.
KEY_FORMAT = 1


def encode_value(value: Any) -> list[str]:
    """A specialization-constant value as ``[type tag, text]``; unknown types raise.

    >>> encode_value(3), encode_value(0.5), encode_value(True), encode_value(b"\\x01")
    (['int', '3'], ['float', '0x1.0000000000000p-1'], ['bool', '1'], ['bytes', '01'])
    """
    if isinstance(value, bool):
        return ["bool", "1" if value else "0"]
    if isinstance(value, int):  # int's own text: a subclass's __str__ is not its value
        try:  # (two members of an int enum with one name had one key, on 3.10 IntEnum's)
            return ["int", int.__repr__(value)]
        except ValueError:  # past int's decimal limit: hex, which no decimal text equals
            return ["int", hex(value)]
    if isinstance(value, float):
        return ["float", float.hex(value)]
    if isinstance(value, str):
        return ["str", value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ["bytes", bytes(value).hex()]
    # numpy scalars and the like: accept what converts losslessly through .item().
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        try:
            return encode_value(item())
        except ValueError:  # an array of more than one element
            raise UnsupportedTypeError(
                f"cannot hash a numpy {type(value).__name__} of shape "
                f"{getattr(value, 'shape', '?')}: use a scalar, or its bytes") from None
    raise UnsupportedTypeError(
        f"cannot hash a value of type {type(value).__name__}: use str, int, float, bool or bytes"
    )


def _iterate(name: str, values: Any) -> list:
    try:
        return list(values)
    except TypeError:
        raise UnsupportedTypeError(
            f"{name} must be a sequence, not {type(values).__name__}") from None


def _str_tuple(name: str, values: Iterable[Any] | str | None) -> tuple[str, ...]:
    if values is None:
        return ()
    if isinstance(values, str):
        raise InvalidArgumentError(f"{name} must be a sequence of strings, not one string")
    out = []
    for v in _iterate(name, values):
        if not isinstance(v, str):
            raise UnsupportedTypeError(
                f"{name} must hold strings; got {type(v).__name__} ({v!r})"
            )
        out.append(v)
    return tuple(out)


def _str_pairs(name: str, values: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> tuple:
    """``(str, str)`` pairs, sorted; other types raise (they have no stable JSON form)."""
    pairs = _pairs(name, values)
    for k, v in pairs:
        if not isinstance(k, str) or not isinstance(v, str):
            raise UnsupportedTypeError(
                f"{name} must hold (str, str) pairs; got ({type(k).__name__}, {type(v).__name__})"
            )
    return tuple(sorted(pairs))


def _pairs(name: str, values: Mapping[Any, Any] | Iterable[tuple[Any, Any]] | None) -> tuple:
    if values is None:
        return ()
    items = values.items() if isinstance(values, Mapping) else _iterate(name, values)
    out = []
    for pair in items:
        try:
            k, v = pair
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{name} must be a mapping or (name, value) pairs") from None
        if not isinstance(k, (str, int)) or isinstance(k, bool):
            raise UnsupportedTypeError(f"{name} keys must be str or int; got {type(k).__name__}")
        encode_value(v)  # validate now, not at hashing time
        out.append((k, v))
    return tuple(sorted(out, key=lambda kv: (isinstance(kv[0], str), str(kv[0]))))


def _strings(values) -> str:
    """A JSON array of strings."""
    return "[" + ",".join(map(_quote, values)) + "]"


def _pairs_json(pairs) -> str:
    """A JSON array of ``[str, str]`` arrays."""
    q = _quote
    return "[" + ",".join(f"[{q(k)},{q(v)}]" for k, v in pairs) + "]"


class HashAttributes:
    """Everything that determines a compiled binary. Equal attributes, equal key.

    ``headers`` is a sequence of ``(include name, sha256 of the header's content)`` pairs:
    headers enter the key by content, never by path. ``compiler`` and ``environment`` are
    ``(name, value)`` pairs. ``name`` labels the entry for listings and is not hashed.

    A frozen value written by hand rather than with ``@dataclass(frozen=True)``: importing
    :mod:`dataclasses` (and the :mod:`inspect` it pulls in) would weigh on the start-up of
    a framework whose start-up should compile nothing.
    """

    #: The attributes that enter the key, in constructor order; ``name`` follows them.
    HASHED = ("backend", "source", "arch", "build_options", "internal_options", "headers",
              "spec_constants", "compiler", "environment")
    FIELDS = HASHED + ("name",)
    __slots__ = FIELDS + ("_encoded", "_key")

    backend: str
    source: str
    arch: str
    build_options: tuple[str, ...]
    internal_options: tuple[str, ...]
    headers: tuple[tuple[str, str], ...]
    spec_constants: tuple[tuple[Any, Any], ...]
    compiler: tuple[tuple[str, str], ...]
    environment: tuple[tuple[str, str], ...]
    name: str

    def __init__(self, backend: str, source: str | bytes, arch: str, *,
                 build_options: Iterable[str] = (), internal_options: Iterable[str] = (),
                 headers: Iterable[tuple[str, str]] | Mapping[str, str] = (),
                 spec_constants: Iterable[tuple[Any, Any]] | Mapping[Any, Any] = (),
                 compiler: Iterable[tuple[str, str]] | Mapping[str, str] = (),
                 environment: Iterable[tuple[str, str]] | Mapping[str, str] = (),
                 name: str = "") -> None:
        set_ = object.__setattr__
        if not isinstance(backend, str) or not backend:
            raise InvalidArgumentError("backend must be a non-empty string such as 'opencl'")
        if isinstance(source, (bytes, bytearray)):
            try:
                source = bytes(source).decode("utf-8")
            except UnicodeDecodeError as err:
                raise InvalidArgumentError(
                    "source is not valid UTF-8; pass the program text as str"
                ) from err
        if not isinstance(source, str):
            raise UnsupportedTypeError(f"source must be str or bytes, not {type(source).__name__}")
        if not source.strip():
            raise InvalidArgumentError("source is empty; pass the kernel's program text")
        check_arch(arch)
        if not isinstance(name, str):
            raise UnsupportedTypeError(f"name must be str, not {type(name).__name__}")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # not in the key: it was its store that failed, always
            raise InvalidArgumentError(
                f"name {name!r} holds a lone surrogate (a file name decoded with "
                "surrogateescape?); pass a proper str, e.g. with os.fsdecode's bytes "
                "decoded with errors='replace'") from None
        set_(self, "backend", backend)
        set_(self, "source", source)
        set_(self, "arch", arch)
        set_(self, "build_options", _str_tuple("build_options", build_options))
        set_(self, "internal_options", _str_tuple("internal_options", internal_options))
        set_(self, "headers", _str_pairs("headers", headers))
        set_(self, "spec_constants", _pairs("spec_constants", spec_constants))
        set_(self, "compiler", _str_pairs("compiler", compiler))
        set_(self, "environment", _str_pairs("environment", environment))
        set_(self, "name", name)
        set_(self, "_encoded", None)
        set_(self, "_key", None)

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError(f"HashAttributes is immutable; use .with_({attr}=...) for a copy")

    def __delattr__(self, attr: str) -> None:
        raise AttributeError("HashAttributes is immutable")

    # Equal when their keys are: Python's own == took 1 for True and 0.0 for -0.0, and a
    # dict a framework keys by attributes served the one's binary for the other.
    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.encoded() == other.encoded()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.encoded())

    def __repr__(self) -> str:
        parts = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.FIELDS)
        return f"HashAttributes({parts})"

    def __reduce__(self):
        return (_from_fields, (tuple(getattr(self, f) for f in self.FIELDS),))

    def canonical(self) -> dict[str, Any]:
        """The attributes as plain JSON data, the exact input of the key."""
        return {
            "format": KEY_FORMAT,
            "backend": self.backend,
            "arch": self.arch,
            "source": self.source,
            "build_options": list(self.build_options),
            "internal_options": list(self.internal_options),
            "headers": [[k, v] for k, v in self.headers],
            "spec_constants": [[encode_value(k), encode_value(v)] for k, v in self.spec_constants],
            "compiler": [[k, v] for k, v in self.compiler],
            "environment": [[k, v] for k, v in self.environment],
        }

    def encoded(self) -> bytes:
        """Canonical bytes: :meth:`canonical` as JSON with sorted keys, no whitespace, UTF-8.

        Written out field by field (the order below is the sorted one); a test holds it
        byte for byte to ``json.dumps(canonical(), sort_keys=True, separators=(",", ":"),
        ensure_ascii=False)``.
        """
        cached = self._encoded
        if cached is None:
            q = _quote
            text = "".join((
                '{"arch":', q(self.arch),
                ',"backend":', q(self.backend),
                ',"build_options":', _strings(self.build_options),
                ',"compiler":', _pairs_json(self.compiler),
                ',"environment":', _pairs_json(self.environment),
                ',"format":', str(KEY_FORMAT),
                ',"headers":', _pairs_json(self.headers),
                ',"internal_options":', _strings(self.internal_options),
                ',"source":', q(self.source),
                ',"spec_constants":[', ",".join(
                    f"[{_strings(encode_value(k))},{_strings(encode_value(v))}]"
                    for k, v in self.spec_constants), "]}",
            ))
            try:
                cached = text.encode("utf-8")
            except UnicodeEncodeError as err:  # lone surrogates, e.g. from surrogateescape
                raise InvalidArgumentError(
                    "an attribute holds text that is not valid Unicode (a lone surrogate); "
                    "pass the program text and options as proper str"
                ) from err
            object.__setattr__(self, "_encoded", cached)
        return cached

    @property
    def key(self) -> str:
        """The sha256 hex digest of :meth:`encoded`."""
        cached = self._key
        if cached is None:
            # OpenSSL's is faster: use it when something has loaded it. Not merely
            # imported: another thread may be halfway through importing it.
            openssl = getattr(sys.modules.get("hashlib"), "sha256", None)
            cached = (openssl or sha256)(self.encoded()).hexdigest()
            object.__setattr__(self, "_key", cached)
        return cached

    @property
    def compiler_free_key(self) -> str:
        """The key of these attributes with the compiler identity left out.

        Stored beside each entry, so that a process that cannot work out its compiler's
        identity (none installed) can still find the entries built for everything else it
        asked for: :mod:`kdb.backends.fallback`.
        """
        if not self.compiler:
            return self.key
        return self.with_(compiler=()).key

    def with_(self, **changes: Any) -> "HashAttributes":
        """A copy with some attributes replaced."""
        unknown = sorted(set(changes) - set(self.FIELDS))
        if unknown:  # as the constructor's other checks: kdb's error, not a TypeError
            raise InvalidArgumentError(f"HashAttributes has no attribute(s) "
                                       f"{', '.join(unknown)}; it has {', '.join(self.FIELDS)}")
        fields = {f: getattr(self, f) for f in self.FIELDS}
        fields.update(changes)
        return HashAttributes(**fields)

    @classmethod
    def from_canonical(cls, data: Mapping[str, Any] | str | bytes, name: str = "") -> "HashAttributes":
        """Rebuild attributes from their stored canonical JSON."""
        if isinstance(data, (str, bytes)):
            import json

            try:
                data = json.loads(data)
            except ValueError as err:
                raise InvalidArgumentError(f"stored attributes are not JSON ({err})") from None
        if not isinstance(data, Mapping):
            raise InvalidArgumentError("stored attributes must be a JSON object, not "
                                       f"{type(data).__name__}")
        if data.get("format") != KEY_FORMAT:
            raise InvalidArgumentError(
                f"attributes use key format {data.get('format')!r}; this kdb knows {KEY_FORMAT}"
            )
        try:
            return cls._from_canonical(data, name)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, KdbError):
                raise
            raise InvalidArgumentError(f"stored attributes are incomplete or malformed "
                                       f"({type(err).__name__}: {err})") from None

    @classmethod
    def _from_canonical(cls, data: Mapping[str, Any], name: str) -> "HashAttributes":
        return cls(
            backend=data["backend"],
            source=data["source"],
            arch=data["arch"],
            build_options=tuple(data["build_options"]),
            internal_options=tuple(data["internal_options"]),
            headers=tuple(tuple(p) for p in data["headers"]),
            spec_constants=tuple(
                (decode_value(k), decode_value(v)) for k, v in data["spec_constants"]
            ),
            compiler=tuple(tuple(p) for p in data["compiler"]),
            environment=tuple(tuple(p) for p in data["environment"]),
            name=name,
        )


def compiler_free_key(attributes: str | bytes) -> str | None:
    """:attr:`HashAttributes.compiler_free_key` of stored canonical attributes (JSON text),
    or ``None`` when the text is not attributes of this key format.

    >>> a = HashAttributes("cuda", "k", "sm_90", compiler={"cc": "1"})
    >>> compiler_free_key(a.encoded()) == a.with_(compiler=()).key
    True
    """
    import json

    try:
        data = json.loads(attributes)
    except (TypeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != KEY_FORMAT:
        return None
    data["compiler"] = []
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    try:
        return sha256(text.encode("utf-8")).hexdigest()
    except UnicodeEncodeError:
        return None


def decode_value(tagged: list[str]) -> Any:
    """Inverse of :func:`encode_value`.

    >>> decode_value(encode_value(2.5)), decode_value(encode_value(b"ab"))
    (2.5, b'ab')
    """
    tag, text = tagged
    if tag == "bool":
        return text == "1"
    if tag == "int":
        return int(text, 16) if "x" in text else int(text)
    if tag == "float":
        return float.fromhex(text)
    if tag == "str":
        return text
    if tag == "bytes":
        return bytes.fromhex(text)
    raise InvalidArgumentError(f"unknown value tag {tag!r} in stored attributes")


def differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Names of the canonical attributes that differ between two encodings (for ``explain``)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _from_fields(values: tuple) -> HashAttributes:
    """Unpickling: the attributes in :attr:`HashAttributes.FIELDS` order."""
    return HashAttributes(**dict(zip(HashAttributes.FIELDS, values)))
