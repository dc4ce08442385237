"""The pure registry records: announcement validation, the JSON codec, the directory view."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl.core.directory import (
    PREFIX,
    Announcement,
    Directory,
    EventKind,
    apply_events,
    decode,
    encode,
    key_for,
)

NAMES = st.text("abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=12)


@st.composite
def announcements(draw: st.DrawFn, name: str | None = None) -> Announcement:
    return Announcement(
        name=name if name is not None else draw(NAMES),
        role=draw(st.sampled_from(["prefill", "decode", "router"])),
        engine=f"10.0.{draw(st.integers(0, 255))}.{draw(st.integers(1, 254))}:"
        f"{draw(st.integers(1, 65535))}",
        gid=f"fe80::{draw(st.integers(0, 0xFFFF)):x}",
        mtu=draw(st.sampled_from([256, 512, 1024, 2048, 4096])),
        capacity=draw(st.integers(0, 10**9)),
        instance=draw(st.text("0123456789abcdef", min_size=16, max_size=16)),
    )


def good(**kw: object) -> Announcement:
    fields: dict[str, Any] = dict(
        name="decode-1",
        role="decode",
        engine="10.0.0.2:5000",
        gid="fe80::1",
        mtu=1024,
        capacity=7,
        instance="0123456789abcdef",
    )
    fields.update(kw)
    return Announcement(**fields)


@given(announcements())
def test_encode_decode_round_trip(ann: Announcement) -> None:
    value = encode(ann)
    assert len(value) < 1024
    assert decode(key_for(ann.name), value) == ann


def test_gid_is_stored_expanded() -> None:
    assert good(gid="FE80::1").gid == "fe80:0000:0000:0000:0000:0000:0000:0001"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("name", "", "registry name"),
        ("name", "a/b", "registry name"),
        ("name", "x" * 65, "registry name"),
        ("role", "de code", "role"),
        ("engine", "10.0.0.2:0", "does not listen"),
        ("engine", "10.0.0.2:5000~ab", "does not listen"),
        ("engine", "10.0.0.2", "no ':port'"),
        ("gid", "not-a-gid", "not an IPv6 address"),
        ("mtu", 1500, "mtu=1500 must be one of"),
        ("mtu", True, "mtu must be an integer"),
        ("capacity", -1, "capacity=-1 out of range"),
        ("capacity", 1.5, "capacity must be an integer"),
        ("instance", "XYZ", "instance"),
    ],
)
def test_bad_field_is_named(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        good(**{field: value})


def _doc(**kw: object) -> bytes:
    doc = json.loads(encode(good()))
    for k, v in kw.items():
        if v is KeyError:
            del doc[k]
        else:
            doc[k] = v
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("/other/decode-1", encode(good()), "not under"),
        (PREFIX + "decode-2", encode(good()), "the key names 'decode-2'"),
        (PREFIX + "decode-1", b"\xff\xfe", "not UTF-8 JSON"),
        (PREFIX + "decode-1", b"[1, 2]", "JSON object"),
        (PREFIX + "decode-1", b"x" * 2000, "2000 bytes"),
        (PREFIX + "decode-1", _doc(v=2), "format version"),
        (PREFIX + "decode-1", _doc(rkey=5), "unexpected \\['rkey'\\]"),
        (PREFIX + "decode-1", _doc(gid=KeyError), "missing \\['gid'\\]"),
        (PREFIX + "decode-1", _doc(mtu="1024"), "mtu must be an integer"),
        (PREFIX + "decode-1", b'{"v":1,"v":1}', "appears twice"),
        (PREFIX + "decode-1", b"[" * 100_000, "at most 1024"),
    ],
)
def test_decode_refuses_with_reason(key: str, value: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode(key, value)


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_decode_of_any_bytes_raises_only_value_error(raw: bytes) -> None:
    with contextlib.suppress(ValueError):
        decode(PREFIX + "n", raw)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["v", "name", "role", "engine", "gid", "mtu", "capacity", "instance", "x"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**70), 2**70),
            st.text(max_size=20),
            st.lists(st.integers(), max_size=3),
            st.floats(allow_nan=True),
        ),
    )
)
def test_decode_of_any_json_object_raises_only_value_error(doc: dict[str, object]) -> None:
    try:
        ann = decode(PREFIX + "n", json.dumps(doc).encode())
    except ValueError:
        return
    assert ann.name == "n"


# -- the directory view -------------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from(["a", "b", "c"]), announcements()),
        st.tuples(st.just("junk"), st.sampled_from(["a", "b", "c"]), st.binary(max_size=8)),
        st.tuples(st.just("del"), st.sampled_from(["a", "b", "c", "zz"]), st.none()),
    ),
    max_size=30,
)


@given(OPS)
def test_events_replayed_rebuild_the_view(ops: list[tuple[str, str, object]]) -> None:
    """Whatever arrives (valid, malformed, deletes), a consumer that replays the events
    from an empty start holds exactly the directory's view, and the view holds only
    well-formed announcements stored under their own names."""
    d = Directory()
    events = []
    for op, name, payload in ops:
        key = PREFIX + name
        if op == "put":
            assert isinstance(payload, Announcement)
            ann = Announcement(**{**_fields(payload), "name": name})
            ev, rej = d.put(key, encode(ann))
            assert rej is None
        elif op == "junk":
            assert isinstance(payload, bytes)
            ev, rej = d.put(key, payload)
            assert rej is not None and rej.key == key
        else:
            ev = d.delete(key)
        if ev is not None:
            events.append(ev)
    members = d.members()
    assert apply_events({}, events) == members
    for name, ann in members.items():
        assert ann.name == name


def _fields(ann: Announcement) -> dict[str, Any]:
    return {f: getattr(ann, f) for f in Announcement.__slots__}


@given(
    st.dictionaries(NAMES, announcements(), max_size=6),
    st.dictionaries(NAMES, announcements(), max_size=6),
)
def test_replace_turns_old_view_into_new(
    old: dict[str, Announcement], new: dict[str, Announcement]
) -> None:
    d = Directory()
    old = {n: Announcement(**{**_fields(a), "name": n}) for n, a in old.items()}
    new = {n: Announcement(**{**_fields(a), "name": n}) for n, a in new.items()}
    d.replace((key_for(n), encode(a)) for n, a in old.items())
    before = d.members()
    events, rejected = d.replace(
        [(key_for(n), encode(a)) for n, a in new.items()] + [(PREFIX + "junk", b"{")]
    )
    assert [r.key for r in rejected] == [PREFIX + "junk"]
    assert d.members() == new
    assert apply_events(before, events) == new
    assert len(events) == len({n for n in old.keys() | new.keys() if old.get(n) != new.get(n)})


def test_kinds_and_restart() -> None:
    d = Directory()
    ev, _ = d.put(key_for("decode-1"), encode(good()))
    assert ev is not None and ev.kind is EventKind.JOIN
    ev, _ = d.put(key_for("decode-1"), encode(good(capacity=3)))
    assert ev is not None and ev.kind is EventKind.UPDATE and not ev.restarted
    ev, _ = d.put(key_for("decode-1"), encode(good(capacity=3, instance="f" * 16)))
    assert ev is not None and ev.restarted
    assert d.put(key_for("decode-1"), encode(good(capacity=3, instance="f" * 16)))[0] is None
    ev, rej = d.put(key_for("decode-1"), b"garbage")
    assert rej is not None and ev is not None and ev.kind is EventKind.LEAVE
    assert d.delete(key_for("decode-1")) is None
    assert d.delete("/elsewhere") is None


def test_directory_is_bounded() -> None:
    d = Directory(max_members=2)
    for i in range(3):
        ev, rej = d.put(key_for(f"n{i}"), encode(good(name=f"n{i}")))
    assert rej is not None and "directory full (2 names)" in rej.reason
    assert sorted(d.members()) == ["n0", "n1"]
    events, rejected = d.replace([(key_for(f"m{i}"), encode(good(name=f"m{i}"))) for i in range(5)])
    assert len(d.members()) == 2 and len(rejected) == 3
