"""What every back end does the same way: source text in, a label for listings out."""

from __future__ import annotations

import itertools
import re

from ..errors import InvalidArgumentError, UnsupportedTypeError


def source_text(source: str | bytes, language: str) -> str:
    """The program text as ``str``; bytes must be UTF-8.

    >>> source_text(b"__kernel void f() {}", "OpenCL")
    '__kernel void f() {}'
    """
    if isinstance(source, (bytes, bytearray)):
        try:
            return bytes(source).decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidArgumentError(f"{language} source is not valid UTF-8") from err
    if not isinstance(source, str):
        raise UnsupportedTypeError(f"source must be str or bytes, not {type(source).__name__}")
    return source


def label(kernel_re: re.Pattern[str], source: str, fallback: str) -> str:
    """A listing label: the first kernel names found by ``kernel_re``, else ``fallback``.

    >>> label(re.compile(r"void (\\w+)"), "void a() void b()", "program")
    'a,b'
    """
    # The first five: a source of many kernels is not scanned to its end for a label.
    names = [m.group(1) for m in itertools.islice(kernel_re.finditer(source), 5)]
    return ",".join(names[:4]) + (",..." if len(names) > 4 else "") if names else fallback
