"""The hash attributes: what enters the key, how it is encoded, and what is refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kdb
from kdb import HashAttributes, InvalidArgumentError, UnsafeArchError, UnsupportedTypeError
from kdb.keys import KEY_FORMAT, differences

BASE = dict(
    backend="opencl",
    source="__kernel void k(__global int *x) { x[0] = N; }",
    arch="pocl-x86_64-znver3",
    build_options=("-DN=4", "-cl-fast-relaxed-math"),
    internal_options=("-cl-std=CL1.2",),
    headers=(("defs.h", "ab" * 32),),
    spec_constants=((1, 7), (0, 2.5)),
    compiler=(("platform", "Portable Computing Language"), ("version", "OpenCL 3.0 PoCL 6.0")),
    environment=(("POCL_DEBUG", "0"),),
    name="k",
)

#: The canonical encoding of BASE and its key, pinned: if either changes, every stored kernel
#: of every user and every system database misses. Bump KEY_FORMAT and update both on purpose.
PINNED_ENCODING = (
    '{"arch":"pocl-x86_64-znver3","backend":"opencl",'
    '"build_options":["-DN=4","-cl-fast-relaxed-math"],'
    '"compiler":[["platform","Portable Computing Language"],["version","OpenCL 3.0 PoCL 6.0"]],'
    '"environment":[["POCL_DEBUG","0"]],"format":1,'
    '"headers":[["defs.h","abababababababababababababababababababababababababababababababab"]],'
    '"internal_options":["-cl-std=CL1.2"],'
    '"source":"__kernel void k(__global int *x) { x[0] = N; }",'
    '"spec_constants":[[["int","0"],["float","0x1.4000000000000p+1"]],[["int","1"],["int","7"]]]}'
)
PINNED_KEY = "02fd80092f5e1ce2a0a8296467a30548334bcb61e19e2243dd5cfd6b591a1b07"


def base(**changes) -> HashAttributes:
    return HashAttributes(**{**BASE, **changes})


# -- what enters the key -------------------------------------------------------------------

CHANGES = {
    "backend": "cuda",
    "source": BASE["source"] + " ",
    "arch": "sm_90",
    "build_options": ("-DN=5", "-cl-fast-relaxed-math"),
    "internal_options": (),
    "headers": (("defs.h", "cd" * 32),),
    "spec_constants": ((1, 8), (0, 2.5)),
    "compiler": (("platform", "Portable Computing Language"), ("version", "OpenCL 3.0 PoCL 6.1")),
    "environment": (("POCL_DEBUG", "1"),),
}


def test_every_hashed_field_has_a_change_case():
    hashed = set(HashAttributes.HASHED)
    assert hashed == set(CHANGES)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_every_attribute_changes_the_key(field):
    a, b = base(), base(**{field: CHANGES[field]})
    assert a.key != b.key
    assert differences(a.canonical(), b.canonical()) == [field]


def test_option_order_and_spelling_matter():
    assert base(build_options=("-cl-fast-relaxed-math", "-DN=4")).key != base().key
    assert base(build_options=("-DN=4",)).key != base(build_options=("-DN=4", "")).key


def test_header_name_changes_the_key():
    assert base(headers=(("other.h", "ab" * 32),)).key != base().key


def test_typed_spec_constants_are_distinct():
    keys = {base(spec_constants=((0, v),)).key for v in (1, 1.0, True, "1", b"\x01")}
    assert len(keys) == 5


def test_name_is_not_hashed():
    a, b = base(name="one"), base(name="two")
    assert a.key == b.key
    assert a == b
    assert "one" not in a.encoded().decode()


def test_pairs_are_normalised_whatever_their_order_or_shape():
    a = base(compiler=dict(reversed(BASE["compiler"])), environment={"POCL_DEBUG": "0"},
             spec_constants={0: 2.5, 1: 7})
    assert a.key == base().key


# -- the canonical encoding ----------------------------------------------------------------

def test_canonical_encoding_is_pinned():
    a = base()
    assert KEY_FORMAT == 1
    assert a.encoded().decode("utf-8") == PINNED_ENCODING
    assert a.key == PINNED_KEY


def test_a_fresh_process_computes_the_pinned_key(run_py):
    out = run_py(f"""
        import kdb
        a = kdb.HashAttributes(**{BASE!r})
        print(a.key, a.encoded().decode())
    """).stdout.split(" ", 1)
    assert out[0] == PINNED_KEY
    assert out[1].rstrip("\n") == PINNED_ENCODING


def test_key_is_sha256_of_encoding():
    import hashlib

    a = base()
    assert a.key == hashlib.sha256(a.encoded()).hexdigest()
    assert json.loads(a.encoded()) == a.canonical()


def test_from_canonical_round_trip():
    a = base()
    for form in (a.encoded(), a.encoded().decode(), a.canonical()):
        b = HashAttributes.from_canonical(form, name="k")
        assert b == a
        assert b.key == a.key
        assert b.encoded() == a.encoded()


def test_from_canonical_refuses_another_key_format():
    data = base().canonical()
    data["format"] = KEY_FORMAT + 1
    with pytest.raises(InvalidArgumentError, match="key format"):
        HashAttributes.from_canonical(data)


def test_with_changes_one_attribute():
    a = base()
    b = a.with_(build_options=("-DN=8",))
    assert b.build_options == ("-DN=8",)
    assert b.source == a.source and b.key != a.key
    assert a.with_().key == a.key
    with pytest.raises(InvalidArgumentError, match="no attribute.*nope"):  # was a TypeError
        a.with_(nope=1)


def test_attributes_are_frozen():
    with pytest.raises(AttributeError):
        base().source = "x"  # type: ignore[misc]


def test_bytes_source_is_decoded():
    assert base(source=BASE["source"].encode()).key == base().key


def test_numpy_scalars_encode_like_python_numbers():
    np = pytest.importorskip("numpy")
    assert base(spec_constants=((0, np.float64(2.5)), (1, np.int32(7)))).key == base().key


# -- what is refused -----------------------------------------------------------------------

@pytest.mark.parametrize("changes", [
    {"spec_constants": ((0, object()),)},
    {"spec_constants": ((0, [1, 2]),)},
    {"spec_constants": ((1.5, 1),)},
    {"spec_constants": ((None, 1),)},
    {"build_options": (1, 2)},
    {"build_options": ("-DN=4", None)},
    {"internal_options": (b"-O2",)},
    {"compiler": (("version", b"3.0"),)},
    {"compiler": (("version", 3),)},
    {"headers": ((1, "ab"), ("b.h", "cd"))},
    {"environment": (("POCL_DEBUG", None),)},
    {"source": 42},
    {"name": 3},
], ids=lambda c: next(iter(c)))
def test_unsupported_types_raise_type_error(changes):
    with pytest.raises(UnsupportedTypeError) as info:
        base(**changes).key  # noqa: B018 - construction or encoding must refuse
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, kdb.KdbError)


@pytest.mark.parametrize("source", [b"\xff\xfe kernel", b"", "", "   \n\t", "ok \udc80"])
def test_bad_source_raises_invalid_argument(source):
    with pytest.raises(InvalidArgumentError):
        base(source=source).key  # noqa: B018


@pytest.mark.parametrize("changes", [
    {"build_options": "-DN=4"},  # one string, not a sequence
    {"backend": ""},
    {"spec_constants": (1, 2)},  # not pairs
])
def test_malformed_arguments_raise_invalid_argument(changes):
    with pytest.raises(InvalidArgumentError):
        base(**changes)


@pytest.mark.parametrize("arch", ["../x", "/abs", "UPPER", "", "a/b", ".hidden", "sm 90", None])
def test_unsafe_arch_raises(arch):
    with pytest.raises(UnsafeArchError) as info:
        base(arch=arch)
    assert isinstance(info.value, InvalidArgumentError)
    assert "sm_90" in str(info.value)  # the message shows what a valid id looks like


@pytest.mark.parametrize("arch", ["sm_90", "gfx90a_sramecc+_xnack-", "pocl-x86_64-znver3", "7"])
def test_safe_arch_accepted(arch):
    assert base(arch=arch).arch == arch


# -- properties ----------------------------------------------------------------------------

_text = st.text(max_size=20)
_ident = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=12)
_value = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), _text,
                   st.binary(max_size=8))
_arch = st.from_regex(r"[a-z0-9][a-z0-9_.+-]{0,10}", fullmatch=True)


@st.composite
def attributes(draw):
    return HashAttributes(
        backend=draw(st.sampled_from(["opencl", "cuda", "x"])),
        source=draw(st.text(min_size=1, max_size=40).filter(str.strip)),
        arch=draw(_arch),
        build_options=tuple(draw(st.lists(_text, max_size=4))),
        internal_options=tuple(draw(st.lists(_text, max_size=3))),
        headers=draw(st.dictionaries(_ident, _text, max_size=3)),
        spec_constants=draw(st.dictionaries(st.one_of(st.integers(0, 99), _ident), _value,
                                            max_size=3)),
        compiler=draw(st.dictionaries(_ident, _text, max_size=3)),
        environment=draw(st.dictionaries(_ident, _text, max_size=3)),
        name=draw(_text),
    )


@settings(max_examples=150, deadline=None)
@given(attributes())
def test_property_round_trip_through_canonical(a):
    b = HashAttributes.from_canonical(a.encoded(), name=a.name)
    assert b.encoded() == a.encoded()
    assert b.key == a.key


@settings(max_examples=150, deadline=None)
@given(attributes())
def test_property_encoding_is_deterministic(a):
    fields = {f: getattr(a, f) for f in HashAttributes.FIELDS}
    again = HashAttributes(**fields)
    assert again.encoded() == a.encoded()
    assert again.key == a.key
    # The key is computed from the value, not cached from elsewhere.
    assert HashAttributes.from_canonical(json.loads(a.encoded())).key == a.key


@settings(max_examples=300, deadline=None)
@given(attributes())
def test_property_encoding_is_json_dumps_of_canonical(a):
    """encoded() writes the JSON itself (json and hashlib cost ~4 ms to import on the hit
    path): it must stay byte for byte what json.dumps makes of canonical(), and the key the
    OpenSSL sha256 of it, for any text (control characters, quotes, non-ASCII)."""
    import hashlib

    want = json.dumps(a.canonical(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert a.encoded() == want.encode("utf-8")
    assert a.key == hashlib.sha256(want.encode("utf-8")).hexdigest()


@settings(max_examples=200, deadline=None)
@given(attributes(), attributes())
def test_property_different_attributes_different_keys(a, b):
    assert (a.key == b.key) == (a.canonical() == b.canonical())


@settings(max_examples=100, deadline=None)
@given(attributes(), st.sampled_from(sorted(CHANGES)), st.data())
def test_property_changing_one_attribute_changes_the_key(a, field, data):
    strategies = {
        "backend": st.sampled_from(["opencl", "cuda", "x", "y"]),
        "source": st.text(min_size=1, max_size=40).filter(str.strip),
        "arch": _arch,
        "build_options": st.lists(_text, max_size=4).map(tuple),
        "internal_options": st.lists(_text, max_size=3).map(tuple),
        "headers": st.dictionaries(_ident, _text, max_size=3),
        "spec_constants": st.dictionaries(st.integers(0, 99), _value, max_size=3),
        "compiler": st.dictionaries(_ident, _text, max_size=3),
        "environment": st.dictionaries(_ident, _text, max_size=3),
    }
    b = a.with_(**{field: data.draw(strategies[field])})
    same = b.canonical()[field] == a.canonical()[field]
    assert (b.key == a.key) == same


def test_attributes_are_immutable_hashable_and_picklable():
    import pickle

    a = HashAttributes(backend="cuda", source="k", arch="sm_90", build_options=["-O3"],
                       spec_constants={1: 2.5}, name="label")
    with pytest.raises(AttributeError):
        a.source = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del a.arch
    b = pickle.loads(pickle.dumps(a))
    assert b == a and b.key == a.key and b.name == "label"
    assert len({a, b, a.with_(name="other")}) == 1  # the name is not hashed
    assert "HashAttributes(backend='cuda'" in repr(a)


def test_an_int_is_keyed_by_its_value_not_its_subclasss_text():
    """An int enum's members (and IntEnum's on 3.10) printed as 'Mode.FAST' whatever their
    value: two kernels built with 1 and 2 had one key, and one was served for the other."""
    import enum

    def member(value: int):
        class Mode(int, enum.Enum):
            FAST = value
        return Mode.FAST

    class Width(int):
        def __str__(self) -> str:
            return "Width"

    def key(value) -> str:
        return HashAttributes("cc", "k", "sm_90", spec_constants={"m": value}).key

    assert key(member(1)) != key(member(2))
    assert key(member(1)) == key(1) and key(Width(64)) == key(64) != key(Width(32))
    assert key(10 ** 5000) != key(10 ** 5000 + 1)  # past int's decimal limit: hex
    huge = HashAttributes("cc", "k", "sm_90", spec_constants={"m": 10 ** 5000})
    assert HashAttributes.from_canonical(huge.encoded()) == huge


def test_equal_attributes_are_those_with_equal_keys():
    """== and hash() compared Python values: True == 1 == 1.0 and 0.0 == -0.0 while the keys
    differ, so a dict keyed by attributes served one's binary for the other; NaN was not
    equal to itself, nor to its pickled copy."""
    import pickle

    def at(value) -> HashAttributes:
        return HashAttributes("cc", "k", "sm_90", spec_constants={"x": value})

    for one, other in ((1, True), (1, 1.0), (0.0, -0.0)):
        assert at(one) != at(other) and at(one).key != at(other).key
        assert {at(one): "one"}.get(at(other)) is None
    nan = at(float("nan"))
    assert nan == pickle.loads(pickle.dumps(nan)) and hash(nan) == hash(at(float("nan")))


@pytest.mark.parametrize("text", ['{"format": 1}', "[1]", "{", '{"format": 1, "backend": 3}'])
def test_malformed_stored_attributes_are_a_kdb_error(text):
    with pytest.raises(kdb.KdbError):
        HashAttributes.from_canonical(text)


def test_bad_names_arrays_and_values_are_kdb_errors():
    import os

    import numpy as np

    with pytest.raises(InvalidArgumentError, match="lone surrogate"):  # its store failed
        HashAttributes("cc", "k", "sm_90", name=os.fsdecode(b"kern_\xff.cl"))
    with pytest.raises(UnsupportedTypeError, match="shape"):
        HashAttributes("cc", "k", "sm_90", spec_constants={"a": np.array([1, 2])}).key
