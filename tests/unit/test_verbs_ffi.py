"""The cffi declarations of libibverbs against the real <infiniband/verbs.h>.

A C program compiled with gcc against the system header prints the size and
alignment of every declared struct and the offset and size of every field
(nested ones too); each must equal what cffi computed from hixl's declarations.
gcc and libibverbs-dev are installed by ``make setup`` (scripts/setup.sh), so
this test fails, never skips, when they are missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from hixl.verbs._ffi import DECLARED_TYPES, ffi

HEADER = Path("/usr/include/infiniband/verbs.h")

# glibc's pthread unions are checked by size and alignment only: their members are
# internals, and what matters is the room they take inside ibv_cq and ibv_qp.
_OPAQUE = {"pthread_mutex_t", "pthread_cond_t"}


def _fields(ctype: Any, prefix: str = "") -> list[tuple[str, int, int]]:
    """``(dotted path, offset, size)`` of every field, recursing into structs and unions."""
    out: list[tuple[str, int, int]] = []
    for name, field in ctype.fields:
        path = prefix + name
        ftype = field.type
        if ftype.kind in ("struct", "union") and ftype.cname not in _OPAQUE:
            # offsets of nested members are relative to their parent: keep the parent's
            base = len(out)
            out.append((path, field.offset, ffi.sizeof(ftype)))
            for sub, off, size in _fields(ftype, path + "."):
                out.append((sub, field.offset + off, size))
            assert out[base][0] == path
        else:
            out.append((path, field.offset, ffi.sizeof(ftype)))
    return out


def _expected() -> dict[str, int]:
    want: dict[str, int] = {}
    for cname in DECLARED_TYPES:
        ctype = ffi.typeof(cname)
        want[f"sizeof {cname}"] = ffi.sizeof(ctype)
        want[f"alignof {cname}"] = ffi.alignof(ctype)
        if cname in _OPAQUE:
            continue
        for path, off, size in _fields(ctype):
            want[f"offsetof {cname} {path}"] = off
            want[f"sizeof {cname} {path}"] = size
    return want


def _c_program(keys: list[str]) -> str:
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <infiniband/verbs.h>",
        "int main(void) {",
    ]
    for key in keys:
        what, rest = key.split(" ", 1)
        if what == "offsetof":
            cname, path = rest.rsplit(" ", 1)
            expr = f"offsetof({cname}, {path})"
        elif what == "alignof":
            expr = f"_Alignof({rest})"
        elif rest in DECLARED_TYPES:
            expr = f"sizeof({rest})"
        else:
            cname, path = rest.rsplit(" ", 1)
            expr = f"sizeof((({cname} *)0)->{path})"
        lines.append(f'    printf("%s=%zu\\n", "{key}", (size_t)({expr}));')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


def test_every_declared_size_and_offset_matches_verbs_h(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    assert gcc is not None, "gcc is needed to check the verbs layouts (make setup installs it)"
    assert HEADER.exists(), f"{HEADER} is missing: install libibverbs-dev (make setup does)"
    want = _expected()
    keys = sorted(want)
    src = tmp_path / "layout.c"
    src.write_text(_c_program(keys))
    exe = tmp_path / "layout"
    subprocess.run([gcc, "-std=gnu11", "-o", str(exe), str(src)], check=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30)
    got = dict(line.rsplit("=", 1) for line in out.stdout.splitlines())
    wrong = {k: (want[k], int(got[k])) for k in keys if int(got[k]) != want[k]}
    assert len(got) == len(keys)
    assert not wrong, f"cffi vs verbs.h (declared, real): {wrong}"


def test_the_known_traps_hold() -> None:
    """The values RXE-NOTES.md recorded, stated directly (they read better than a diff)."""
    assert ffi.sizeof("struct ibv_send_wr") == 128
    # A ring slot's SGE lives in the union of bind_mw and tso (hixl.verbs.slot_ring).
    assert ffi.offsetof("struct ibv_send_wr", "bind_mw") == 80
    assert ffi.offsetof("struct ibv_context", "ops", "poll_cq") == 96
    assert ffi.offsetof("struct ibv_context", "ops", "post_send") == 208
    assert ffi.offsetof("struct ibv_context", "ops", "post_recv") == 216
    assert ffi.sizeof("struct ibv_wc") == 48
    assert ffi.sizeof("struct ibv_sge") == 16


def _shape(t: Any) -> Any:
    """What a type is, all the way down: kind, name, size, and its fields' shapes."""
    if t.kind in ("struct", "union"):
        fields = [(n, f.offset, f.bitsize, _shape(f.type)) for n, f in t.fields or ()]
        return (t.kind, t.cname, ffi.sizeof(t), fields)
    return (t.kind, t.cname)


def test_the_prebuilt_tables_are_in_use_and_describe_exactly_cdef() -> None:
    from hixl.verbs import _ffi
    from hixl.verbs._ffi_tables import ffi as prebuilt

    assert _ffi.ffi is prebuilt, "the verbs layer parses CDEF at import: run `make ffi`"
    parsed = _ffi.parse()
    for cname in DECLARED_TYPES:
        assert _shape(prebuilt.typeof(cname)) == _shape(parsed.typeof(cname)), (
            f"{cname} differs from CDEF: run `make ffi`"
        )
    names = re.findall(r"^[\w ]+?[ *](ibv_\w+)\(", _ffi.CDEF, re.M)
    assert len(names) > 20
    new, old = prebuilt.dlopen(_ffi.LIBRARY), parsed.dlopen(_ffi.LIBRARY)
    for name in names:
        got, want = prebuilt.typeof(getattr(new, name)), parsed.typeof(getattr(old, name))
        assert got.cname == want.cname, f"{name}: {got.cname} vs {want.cname}: run `make ffi`"
    for slot in (_ffi.POLL_CQ, _ffi.REQ_NOTIFY_CQ, _ffi.POST_SEND, _ffi.POST_RECV):
        assert prebuilt.typeof(slot).kind == "function"  # "pointer to function" in cffi
