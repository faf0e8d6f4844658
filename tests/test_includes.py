"""Headers enter the key by content: edits miss, paths do not matter."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kdb import HashAttributes
from kdb.backends.digests import file_digest
from kdb.backends.cloptions import compiler_tokens, key_options, parse_search
from kdb.backends.includes import IncludeSearch, UncertainIncludes, read_headers

SOURCE = '#include "defs.h"\n__kernel void k(__global float *x) { x[0] = SCALE; }\n'


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def header_digests(source: str, dirs, source_dir: str | None = None):
    """The headers of ``source`` searched for in ``dirs`` (a program read from a file in
    ``source_dir``, else one whose own directory holds nothing)."""
    search = IncludeSearch(dirs=[(os.fspath(d),) for d in dirs])
    return read_headers(source, search, source_dir or os.path.abspath(os.sep),
                        main_in_cwd=source_dir is not None, cwd_in_path=False)


def attrs_for(source: str, dirs, options=()) -> HashAttributes:
    return HashAttributes(backend="opencl", source=source, arch="pocl-x86_64-znver3",
                          build_options=tuple(key_options(options)),
                          headers=header_digests(source, dirs))


def test_header_is_digested_by_content(tmp_path):
    h = write(tmp_path / "inc" / "defs.h", "#define SCALE 2.0f\n")
    got = dict(header_digests(SOURCE, [tmp_path / "inc"]))
    assert got == {"defs.h": file_digest(h)}
    assert str(tmp_path) not in repr(got)  # no path enters the result


def test_header_edit_changes_digests_and_key(tmp_path):
    inc = tmp_path / "inc"
    write(inc / "defs.h", "#define SCALE 2.0f\n")
    before = attrs_for(SOURCE, [inc])
    write(inc / "defs.h", "#define SCALE 3.0f\n")  # same size
    after = attrs_for(SOURCE, [inc])
    assert before.headers != after.headers
    assert before.key != after.key


@pytest.mark.parametrize("line", [
    "#include <{}>", "#include/**/<{}>", "/* c */ #include <{}>", "/* c\n d */ #include <{}>",
    "#/**/include <{}>", "#if __has_include(<{}>)\n#include <{}>\n#endif"])
@pytest.mark.parametrize("name", ["a//b.h", "a/*x*/b.h"])
def test_an_angle_header_name_is_one_token_comments_and_all(tmp_path, name, line):
    """``<a//b.h>`` names the file ``a/b.h`` (and ``<a/*x*/b.h>`` a directory ``*x*``):
    the preprocessor reads a header name before it strips comments, also after comments on
    its line and in ``__has_include``. kdb read them as comments: the first was uncertain
    (compiled at every start), the second keyed as a missing ``a b.h`` and served stale."""
    inc = tmp_path / "inc"
    h = write(inc / name.replace("//", "/"), "#define SCALE 2.0f\n")
    source = (line.format(name, name) + " // the scale\n"
              "__kernel void k(__global float *x) { x[0] = SCALE; }\n")
    got = dict(header_digests(source, [inc]))
    assert set(got.values()) == {file_digest(h)} and name in got, got


@pytest.mark.parametrize("before", ["#ifdef NEVER\ndon't build this: /* old\n#endif",
                                    '#if 0\nsay "hi /* \n#endif',
                                    "#warning can't /* x",
                                    'const char *s = R"(a " /*)";',  # C++ (CUDA, HIP)
                                    "int x = 1'0 + '/*';"])
def test_a_quote_left_open_ends_with_its_line_and_opens_no_comment(tmp_path, before):
    """clang ends a character or string literal left open at the end of its line, so a
    ``/*`` after ``don't`` opens no comment, and in C++ reads raw strings and digit
    separators whole; kdb read a comment up to the next ``*/`` and the ``#include``
    between was not in the key (a stale kernel after an edit of the header)."""
    inc = tmp_path / "inc"
    h = write(inc / "val.h", "#define VAL 1\n")
    source = before + '\n#include "val.h"\n/* ok */\nkernel void k(global int *o) { o[0] = VAL; }\n'
    assert dict(header_digests(source, [inc])) == {"val.h": file_digest(h)}


def test_same_size_edit_within_timestamp_granularity_is_seen(tmp_path):
    """A file system with coarse timestamps can give two quick writes one mtime."""
    h = write(tmp_path / "defs.h", "#define SCALE 2.0f\n")
    first = file_digest(h)
    st = os.stat(h)
    h.write_text("#define SCALE 3.0f\n")
    os.utime(h, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert file_digest(h) != first


def test_settled_file_digest_is_memoized(tmp_path, monkeypatch):
    """A warm start does not read its headers again: a settled file's digest is memoised
    under its stamp; a rewrite that keeps size and mtime changes the stamp (its ctime)."""
    from kdb.backends import digests

    monkeypatch.setattr(digests, "_SETTLED_S", 0.3)
    h = write(tmp_path / "old.h", "#define A 1\n")
    os.utime(h, (1_000_000_000, 1_000_000_000))
    time.sleep(0.4)
    first = file_digest(h)
    assert digests._memo[(str(h), *digests.stamp(os.stat(h)))] == first
    st = os.stat(h)
    h.write_text("#define A 2\n")
    os.utime(h, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(h) != first


def test_nested_includes_are_followed(tmp_path):
    inc = tmp_path / "inc"
    write(inc / "defs.h", '#include "inner/more.h"\n#define SCALE MORE\n')
    inner = write(inc / "inner" / "more.h", "#include <deep.h>\n#define MORE 2.0f\n")
    write(inc / "deep.h", "#define DEEP 1\n")
    got = dict(header_digests(SOURCE, [inc]))
    assert set(got) == {"defs.h", "defs.h>inner/more.h", "defs.h>inner/more.h>deep.h"}
    before = attrs_for(SOURCE, [inc]).key
    write(inner.parent.parent / "deep.h", "#define DEEP 2\n")
    assert attrs_for(SOURCE, [inc]).key != before


def test_quoted_include_searches_the_including_files_directory_first(tmp_path):
    inc = tmp_path / "inc"
    write(inc / "sub" / "a.h", '#include "b.h"\n')
    local = write(inc / "sub" / "b.h", "// next to a.h\n")
    write(inc / "b.h", "// in the include dir\n")
    got = dict(header_digests('#include "sub/a.h"\n', [inc]))
    assert got["sub/a.h>b.h"] == file_digest(local)


def test_angle_include_skips_the_source_directory(tmp_path):
    src_dir = write(tmp_path / "src" / "x.h", "// beside the source\n").parent
    inc_h = write(tmp_path / "inc" / "x.h", "// include dir\n")
    got = dict(header_digests("#include <x.h>\n", [tmp_path / "inc"], source_dir=str(src_dir)))
    assert got == {"x.h": file_digest(inc_h)}
    got = dict(header_digests('#include "x.h"\n', [tmp_path / "inc"], source_dir=str(src_dir)))
    # every match along the path enters: the compiler takes the first, the key holds both
    assert got == {"x.h": file_digest(src_dir / "x.h"), "x.h|2": file_digest(inc_h)}


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_a_header_reached_in_two_directories_is_followed_in_each(link, tmp_path):
    """``x/a.h`` and ``y/a.h`` one file: its ``#include "b.h"`` is ``x/b.h`` from the one and
    ``y/b.h`` from the other, as gcc and NVRTC look. Followed once per inode, ``y/b.h``
    never entered the key, and NVRTC was served a binary built with its old content."""
    write(tmp_path / "x" / "a.h", '#include "b.h"\n')
    (tmp_path / "y").mkdir()
    if link == "symlink":
        (tmp_path / "y" / "a.h").symlink_to("../x/a.h")
    else:
        os.link(tmp_path / "x" / "a.h", tmp_path / "y" / "a.h")
    write(tmp_path / "x" / "b.h", "#define XV 1\n")
    yb = write(tmp_path / "y" / "b.h", "#define YV 2\n")
    src = '#include "x/a.h"\n#include "y/a.h"\n'
    got = dict(header_digests(src, [tmp_path]))
    assert got["y/a.h>b.h"] == file_digest(yb)
    assert got["x/a.h>b.h"] == file_digest(tmp_path / "x" / "b.h")


def test_a_link_to_its_own_directory_is_followed_once(tmp_path):
    """``sub`` -> ``.``: ``a.h`` reached as ``sub/a.h``, ``sub/sub/a.h``, ... is one
    directory, however the path grows."""
    write(tmp_path / "a.h", '#include "sub/a.h"\n')
    (tmp_path / "sub").symlink_to(".")
    got = dict(header_digests('#include "a.h"\n', [tmp_path]))
    assert set(got) == {"a.h", "a.h>sub/a.h"}


def test_include_cycle_terminates(tmp_path):
    write(tmp_path / "a.h", '#pragma once\n#include "b.h"\n')
    write(tmp_path / "b.h", '#pragma once\n#include "a.h"\n')
    got = dict(header_digests('#include "a.h"\n', [tmp_path]))
    assert {"a.h", "a.h>b.h", "a.h>b.h>a.h"} <= set(got)


def test_includes_inside_conditionals_are_followed(tmp_path):
    write(tmp_path / "fast.h", "// fast\n")
    src = "#ifdef FAST\n#  include <fast.h>\n#endif\n__kernel void k() {}\n"
    assert dict(header_digests(src, [tmp_path])) == {"fast.h": file_digest(tmp_path / "fast.h")}


def test_missing_include_is_recorded_as_missing(tmp_path):
    got = dict(header_digests('#include "nowhere.h"\n#include <CL/cl.h>\n', [tmp_path]))
    assert got == {"nowhere.h": "missing", "CL/cl.h": "missing"}
    # Creating the header later changes the key: the build would now succeed differently.
    before = attrs_for('#include "nowhere.h"\n__kernel void k() {}', [tmp_path]).key
    write(tmp_path / "nowhere.h", "#define X 1\n")
    assert attrs_for('#include "nowhere.h"\n__kernel void k() {}', [tmp_path]).key != before


def test_a_macro_include_is_uncertain_in_every_back_end(tmp_path):
    write(tmp_path / "one.h", "// one\n")
    with pytest.raises(UncertainIncludes) as info:
        header_digests("#define HEADER <one.h>\n#include HEADER\n", [tmp_path])
    assert info.value.kind == "macro"


def test_result_is_sorted_and_deterministic(tmp_path):
    for n in "cab":
        write(tmp_path / f"{n}.h", f"// {n}\n")
    src = '#include "c.h"\n#include "a.h"\n#include "b.h"\n'
    got = header_digests(src, [tmp_path])
    assert [name for name, _ in got] == ["a.h", "b.h", "c.h"]
    assert header_digests(src, [str(tmp_path)]) == got


def test_same_headers_in_two_virtual_environments_give_one_key(tmp_path):
    """Different install prefix, different header directory, same header content."""
    venvs = [tmp_path / "venv-a" / "lib" / "python3.12" / "site-packages" / "pyopencl" / "cl",
             tmp_path / "opt" / "other-env" / "include"]
    for d in venvs:
        write(d / "defs.h", '#include "helpers.h"\n#define SCALE 2.0f\n')
        write(d / "helpers.h", "inline float twice(float x) { return 2 * x; }\n")
    a = attrs_for(SOURCE, [venvs[0]], ["-DN=4", "-I", str(venvs[0])])
    b = attrs_for(SOURCE, [venvs[1]], ["-DN=4", f"-I{venvs[1]}"])
    assert a.headers == b.headers
    assert a.key == b.key
    assert str(tmp_path) not in a.encoded().decode()


def test_key_differs_when_one_environment_has_a_different_header(tmp_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    write(a_dir / "defs.h", "#define SCALE 2.0f\n")
    write(b_dir / "defs.h", "#define SCALE 2.5f\n")
    assert attrs_for(SOURCE, [a_dir]).key != attrs_for(SOURCE, [b_dir]).key


@pytest.mark.parametrize("options, rest", [
    (["-I", "/a"], []),
    (["-I/a"], []),
    (['-I"/c d"'], []),
    (["-I", '"/c d"'], []),
    (["-DN=4", "-I", "/a", "-cl-mad-enable", "-I/b"], ["-DN=4", "-cl-mad-enable"]),
    (["-I"], []),  # dangling -I: nothing to add, nothing to keep
    (["-include", "x.h", "-Dfoo=-I/x"], ["-include", "x.h", "-Dfoo=-I/x"]),
    (["-I inc -DN=8"], ["-DN=8"]),  # the driver reads the joined string: two options
    (["-I", "inc -DN=8"], ["-DN=8"]),
    (["-D", "-Ix"], ["-D", "-Ix"]),  # -D's value, not an include dir
    (['-I"/c d" -DX="1 2"'], ['-I"/c d" -DX="1 2"']),  # quotes and more: kept whole
    ([], []),
])
def test_key_options(options, rest):
    assert key_options(options) == rest


def test_key_options_accepts_any_iterable():
    assert key_options(iter(["-I", "/a", "-DX"])) == ["-DX"]


def test_include_paths_do_not_enter_the_key_but_other_options_do(tmp_path):
    write(tmp_path / "x" / "defs.h", "#define SCALE 1\n")
    write(tmp_path / "y" / "defs.h", "#define SCALE 1\n")
    a = attrs_for(SOURCE, [tmp_path / "x"], ["-I", str(tmp_path / "x"), "-DN=1"])
    b = attrs_for(SOURCE, [tmp_path / "y"], ["-I", str(tmp_path / "y"), "-DN=1"])
    c = attrs_for(SOURCE, [tmp_path / "y"], ["-I", str(tmp_path / "y"), "-DN=2"])
    assert a.key == b.key != c.key


def test_opencl_attributes_are_portable_across_environments(tmp_path, cl_ctx):
    """The OpenCL back end's attributes, with pyopencl-style -I options from two installs."""
    from kdb.backends.opencl import attributes_for

    dev = cl_ctx.devices[0]
    keys = []
    for prefix in ("envA/lib/site-packages", "somewhere/else/entirely"):
        d = tmp_path / prefix / "pyopencl" / "cl"
        write(d / "defs.h", "#define SCALE 2.0f\n")
        attrs = attributes_for(dev, SOURCE, ["-DN=4"], ["-I", str(d)], name="k",
                               memo_dir=str(tmp_path))
        assert dict(attrs.headers)["defs.h"] != "missing"
        assert str(tmp_path) not in attrs.encoded().decode()
        keys.append(attrs.key)
    assert keys[0] == keys[1]


# -- read_headers: what an OpenCL C compiler reads ------------------------------------------

from kdb.backends.includes import directives  # noqa: E402


def headers(source: str, options: str, cwd) -> dict[str, str]:
    return dict(read_headers(source, parse_search(options), str(cwd)))


@pytest.mark.parametrize("options", [
    "-I {d}", "-I{d}", "-DX=1 -I{d}", "-DX=1 -I {d}", '-I"{d}"', '-I "{d}"', "-I={d}",
    "--include-directory {d}", "--include-directory={d}", "-isystem {d}", "-isystem{d}",
    "-iquote {d}", "-iquote{d}",
])
def test_every_include_dir_form_finds_the_header_and_sees_its_edit(options, tmp_path):
    d = tmp_path / "inc dir" if '"' in options else tmp_path / "inc"
    h = write(d / "h.h", "#define K 2\n")
    work = (tmp_path / "work")
    work.mkdir()
    opts = options.format(d=d)
    before = headers('#include "h.h"\n', opts, work)
    assert before == {"h.h": file_digest(h)}
    write(h, "#define K 3\n")
    assert headers('#include "h.h"\n', opts, work) != before


def test_include_option_finds_the_file_from_the_working_directory(tmp_path):
    h = write(tmp_path / "forced.h", "#define K 2\n")
    got = headers("__kernel void k() {}", "-include forced.h", tmp_path)
    assert got == {"+forced.h": file_digest(h)}


def test_options_are_split_as_the_compiler_splits_the_joined_string():
    """pyopencl joins list elements with spaces: ["-DX=1 -I/a"] is two options."""
    s = parse_search(b"-DX=1 -I/a -D -I/not-a-dir -I -DY -cl-mad-enable")
    assert [r[0] for r in s.dirs] == ["/a", "-DY"]
    assert compiler_tokens('-I"/a b" x') == [("-I/a b", "-I /a b "), ("x", None)]


@pytest.mark.parametrize("option", ["-imacros m.h", "-idirafter /x", "-nostdinc", "-I-",
                                    "--sysroot=/x", "-iprefix /x", "-include-pch x.pch",
                                    "-isystem-after /x", "--include-directory-after /x"])
def test_an_include_option_kdb_does_not_model_makes_the_build_uncertain(option):
    with pytest.raises(UncertainIncludes) as info:
        read_headers("__kernel void k() {}", parse_search(option))
    assert info.value.kind == "option"


def test_the_working_directory_is_searched_first_for_the_program(tmp_path):
    """PoCL builds the program from a temporary file with -I. (checked with a real build:
    tests/test_include_builds.py); a header beside the cwd and in -I both count."""
    here = write(tmp_path / "h.h", "// cwd\n")
    there = write(tmp_path / "inc" / "h.h", "// -I\n")
    got = headers("#include <h.h>\n", f"-I {tmp_path / 'inc'}", tmp_path)
    assert got == {"h.h": file_digest(here), "h.h|2": file_digest(there)}


def test_nested_quoted_include_searches_its_own_dir_then_the_path(tmp_path):
    inc = tmp_path / "inc"
    write(inc / "sub" / "a.h", '#include "b.h"\n')
    own = write(inc / "sub" / "b.h", "// beside a.h\n")
    other = write(inc / "b.h", "// in -I\n")
    got = headers('#include "sub/a.h"\n', f"-I {inc}", tmp_path)
    assert got["sub/a.h>b.h"] == file_digest(own)
    assert got["sub/a.h>b.h|2"] == file_digest(other)


def test_directives_after_splicing_and_without_comments():
    src = ('#\\\ninclude "a.h"\n#  include <b.h>\n/* #include "c.h" */\n// #include "d.h"\n'
           '# /* x */ include "e.h"\n#include_next <f.h>\n#if __has_include("g.h")\n#endif\n'
           '__constant char s[] = "/* #include \\"z.h\\" */";\n')
    got, problem = directives(src)
    assert problem is None
    assert got == ((True, "a.h"), (False, "b.h"), (True, "e.h"), (False, "f.h"), (True, "g.h"))


@pytest.mark.parametrize("src", ['#define H "h.h"\n#include H\n', "#include MAKE(h)\n",
                                 "#if __has_include(H)\n#endif\n"])
def test_an_include_named_by_a_macro_is_uncertain(src, tmp_path):
    with pytest.raises(UncertainIncludes) as info:
        headers(src, "", tmp_path)
    assert info.value.kind == "macro"


def test_a_macro_include_inside_a_header_is_uncertain(tmp_path):
    write(tmp_path / "h.h", "#include OTHER\n")
    with pytest.raises(UncertainIncludes, match="in 'h.h'"):
        headers('#include "h.h"\n', "", tmp_path)


def test_a_fifo_is_uncertain_and_never_opened(tmp_path):
    os.mkfifo(tmp_path / "h.h")  # opening it would block: kdb only looks at its type
    with pytest.raises(UncertainIncludes, match="not a regular file") as info:
        headers('#include "h.h"\n', "", tmp_path)
    assert info.value.kind == "not a file"


def test_a_header_that_cannot_be_looked_up_is_uncertain(tmp_path):
    os.symlink("h.h", tmp_path / "h.h")  # a loop: stat fails with ELOOP, not "no such file"
    with pytest.raises(UncertainIncludes) as info:
        headers('#include "h.h"\n', "", tmp_path)
    assert info.value.kind == "unreadable"


def test_a_directory_is_skipped_as_the_compiler_skips_it(tmp_path):
    (tmp_path / "h.h").mkdir()
    h = write(tmp_path / "inc" / "h.h", "// the file\n")
    assert headers('#include "h.h"\n', f"-I {tmp_path / 'inc'}", tmp_path) == {
        "h.h": file_digest(h)}


def test_a_header_found_nowhere_is_missing(tmp_path):
    assert headers('#include "nowhere.h"\n', "", tmp_path) == {"nowhere.h": "missing"}


def test_a_source_without_include_costs_no_lookup(tmp_path):
    assert headers("__kernel void k() {}", f"-I {tmp_path}", "/nonexistent") == {}


def test_a_deleted_working_directory_finds_nothing_there(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert dict(read_headers('#include "h.h"\n', parse_search(""))) == {"h.h": "missing"}
