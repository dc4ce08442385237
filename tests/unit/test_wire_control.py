"""Tests for hixl.core.wire's control frames: region announcements cut to fit a frame,
the decoder's frame limit, and the fast path of REGIONS decoding."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wire_strategies import (
    FUZZ,
    frame,
    region_tuples,
    u32,
)

from hixl.core import wire
from hixl.core.wire import (
    HEADER_SIZE,
    REMOTE_READ,
    REMOTE_WRITE,
    MsgType,
    Regions,
    RemoteRegion,
    decode,
    encode,
    expect,
    region_size,
)
from hixl.errors import HandshakeError

# --------------------------------------------------------------------------- control frames


def _region(i: int, name_len: int = 128) -> RemoteRegion:
    return RemoteRegion(
        addr=0x10000 + i * 4096, length=4096, rkey=i + 1, access=6, name=f"{i:0{name_len}d}"
    )


def _apply_all(
    frames: list[bytes], start: dict[tuple[int, int], RemoteRegion], max_payload: int
) -> set[tuple[int, int]]:
    held = dict(start)
    for f in frames:
        msg = wire.decode(f, max_payload=max_payload)
        assert isinstance(msg, wire.Regions)
        for r in msg.remove:
            held.pop((r.rkey, r.addr), None)
        for r in msg.add:
            held[(r.rkey, r.addr)] = r
    return set(held)


@pytest.mark.parametrize("n_add, n_remove", [(1, 0), (0, 1), (4096, 0), (0, 4096), (3000, 1096)])
def test_regions_frames_fit_a_control_frame_and_change_the_same(n_add: int, n_remove: int) -> None:
    regions = [_region(i) for i in range(n_add + n_remove)]
    add, remove = tuple(regions[:n_add]), tuple(regions[n_add:])
    frames = wire.regions_frames(add, remove)
    sizes = [len(f) - HEADER_SIZE for f in frames]
    assert max(sizes) <= wire.CONTROL_MAX_PAYLOAD, max(sizes)
    whole = wire.encode(wire.Regions(add=add, remove=remove))
    assert (len(frames) == 1) == (len(whole) - HEADER_SIZE <= wire.CONTROL_MAX_PAYLOAD)
    start = {(r.rkey, r.addr): r for r in remove}
    assert _apply_all(frames, start, wire.CONTROL_MAX_PAYLOAD) == {(r.rkey, r.addr) for r in add}


def test_regions_frames_a_region_too_large_alone_raises() -> None:
    with pytest.raises(HandshakeError, match="exceeds max_payload=64"):
        wire.regions_frames((_region(1),), max_payload=64)


def test_decoder_limit_refuses_larger_frames_from_then_on() -> None:
    big = wire.encode(wire.Regions(add=tuple(_region(i) for i in range(200))))
    assert len(big) - HEADER_SIZE > wire.CONTROL_MAX_PAYLOAD
    dec = wire.Decoder()
    dec.limit(wire.CONTROL_MAX_PAYLOAD)
    with pytest.raises(HandshakeError, match=f"max_payload={wire.CONTROL_MAX_PAYLOAD}"):
        dec.feed(big)
    assert dec.error_code == wire.ErrorCode.MALFORMED


def test_decoder_limit_fails_a_frame_already_announced_larger() -> None:
    big = wire.encode(wire.Regions(add=tuple(_region(i) for i in range(200))))
    dec = wire.Decoder()
    assert dec.feed(big[:100]) == []
    with pytest.raises(HandshakeError, match="more than max_payload"):
        dec.limit(wire.CONTROL_MAX_PAYLOAD)
    with pytest.raises(HandshakeError, match="unusable"):
        dec.feed(b"")


def test_decoder_limit_only_lowers() -> None:
    with pytest.raises(ValueError, match="out of range"):
        wire.Decoder(max_payload=1024).limit(2048)


def _apply_each(
    held: dict[tuple[int, int], RemoteRegion],
    changes: list[tuple[tuple[RemoteRegion, ...], tuple[RemoteRegion, ...]]],
) -> dict[tuple[int, int], RemoteRegion]:
    """A receiver's view after each change in turn: removals first, then additions."""
    held = dict(held)
    for add, remove in changes:
        for r in remove:
            held.pop((r.rkey, r.addr), None)
        for r in add:
            held[(r.rkey, r.addr)] = r
    return held


# Regions over a few (rkey, addr) keys, some keys with two different regions (another
# length or name), so changes collide.
_POOL = [
    RemoteRegion(addr=0x1000 * (k % 3), length=4096 * v, rkey=k, access=6, name=f"k{k}v{v}")
    for k in range(1, 7)
    for v in (1, 2)
]
_CHANGE = st.tuples(
    st.lists(st.sampled_from(_POOL), max_size=4).map(
        lambda rs: tuple({(r.rkey, r.addr): r for r in rs}.values())
    ),
    st.lists(st.sampled_from(_POOL), max_size=4).map(
        lambda rs: tuple({(r.rkey, r.addr): r for r in rs}.values())
    ),
)


@given(start=st.lists(st.sampled_from(_POOL)), changes=st.lists(_CHANGE, max_size=12))
def test_region_changes_merged_leave_the_receiver_where_each_would(
    start: list[RemoteRegion],
    changes: list[tuple[tuple[RemoteRegion, ...], tuple[RemoteRegion, ...]]],
) -> None:
    held = {(r.rkey, r.addr): r for r in start}
    pending = wire.RegionChanges()
    for add, remove in changes:
        pending.note(add, remove)
    assert len(pending) <= len({(r.rkey, r.addr) for a, d in changes for r in a + d})
    add, remove = pending.take()
    assert len(pending) == 0 and pending.take() == ((), ())
    frames = wire.regions_frames(add, remove) if add or remove else []
    got = dict(held)
    for f in frames:
        msg = wire.decode(f, max_payload=wire.CONTROL_MAX_PAYLOAD)
        assert isinstance(msg, wire.Regions)
        got = _apply_each(got, [(msg.add, msg.remove)])
    assert got == _apply_each(held, changes)


# A REGIONS payload as encode() writes it is read by a fast path (regular expressions, no
# JSON hooks); any other by the general one.  Values put in place of a field's: edge
# values, other literals, names with escapes, control characters or broken UTF-8.
_LITERALS = [
    b"0", b"-1", b"1", b"00", b"01", b"-0", b"1.0", b"1e3", b"true", b"null", b'"7"', b"2",
    b"4294967295", b"4294967296", b"18446744073709551615", b"18446744073709551616",
    b"9223372036854775808", b"123456789012345678901234", b"6", b"7", b" 6", b"[]",
    b'""', b'"a\\"b"', b'"\\u0041"', b'"\\n"', b'"\x01"', b'"\x7f"', b'"\xff"', b'"\xc2\xa0"',
    b'"\xc3\xa9"', b'"\xed\xa0\x80"', b'"\xe2\x80\xa8"', b'"' + b"x" * 129 + b'"', b"6,6",
]  # fmt: skip
_SPLICES = st.sampled_from([b" ", b",", b"]", b"[", b"{", b"}", b'"', b":", b"\\", b"0"])
_plain_names = st.text(st.sampled_from("ab09 ,:[]{}\u00e9\u4e2d"), max_size=8)
_plain_regions = st.lists(
    st.builds(
        RemoteRegion,
        addr=st.integers(0, 1 << 40),
        length=st.integers(1, 1 << 20),
        rkey=u32,
        access=st.sampled_from([REMOTE_WRITE, REMOTE_READ, REMOTE_WRITE | REMOTE_READ]),
        name=_plain_names,
    ),
    max_size=4,
)


def _region_text(fields: list[tuple[str, bytes]]) -> bytes:
    return b"{" + b",".join(b'"%s":%s' % (k.encode(), v) for k, v in fields) + b"}"


def _payload(add: list[bytes], remove: list[bytes]) -> bytes:
    return b'{"add":[%s],"remove":[%s]}' % (b",".join(add), b",".join(remove))


@st.composite
def regions_payloads(draw: st.DrawFn) -> bytes:
    """A REGIONS payload written field by field as encode() would, maybe with one value
    replaced, a region repeated or a byte spliced in."""
    lists: list[list[list[tuple[str, bytes]]]] = []
    for _ in ("add", "remove"):
        regions = draw(_plain_regions)
        if regions and draw(st.integers(0, 3)) == 0:
            regions.append(draw(st.sampled_from(regions)))  # repeated
        lists.append(
            [
                [
                    (f, json.dumps(getattr(r, f), ensure_ascii=False).encode())
                    for f in wire._REGION_KEYS
                ]
                for r in regions
            ]
        )
    fields = [(region, i) for regions in lists for region in regions for i in range(5)]
    edit: bool = draw(st.booleans())
    if fields and edit:
        edited, i = draw(st.sampled_from(fields))
        edited[i] = (edited[i][0], draw(st.sampled_from(_LITERALS)))
    payload = _payload(*([_region_text(r) for r in regions] for regions in lists))
    if draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(payload)))
        payload = payload[:at] + draw(_SPLICES) + payload[at + draw(st.integers(0, 2)) :]
    return payload


def _read_both(payload: bytes) -> tuple[Regions | None, Regions | HandshakeError]:
    """What the fast path and the general path make of ``payload``."""
    fast = wire._fast_regions(payload)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(wire, "_fast_regions", lambda payload: None)
        try:
            general: Regions | HandshakeError = expect(
                decode(frame(MsgType.REGIONS, payload)), Regions
            )
        except HandshakeError as exc:
            general = exc
    return fast, general


def test_regions_fast_path_with_each_value_replaced() -> None:
    """Each field of a region, in either list, replaced by each literal in turn: the fast
    path returns what the general path returns, or nothing."""
    plain = [
        (f, json.dumps(v).encode())
        for f, v in zip(wire._REGION_KEYS, (4096, 8192, 7, 6, "kv"), strict=True)
    ]
    taken = 0
    for where in (0, 1):
        for i in range(5):
            for literal in _LITERALS:
                fields = list(plain)
                fields[i] = (fields[i][0], literal)
                lists: list[list[bytes]] = [[], []]
                lists[where] = [_region_text(fields)]
                fast, general = _read_both(_payload(*lists))
                if fast is not None:
                    assert general == fast, (fields, general)
                    taken += 1
    assert taken > 10  # the fast path is not dead


@FUZZ
@given(add=region_tuples, remove=region_tuples, payload=regions_payloads())
def test_regions_fast_path_reads_what_the_general_path_reads(
    add: tuple[RemoteRegion, ...], remove: tuple[RemoteRegion, ...], payload: bytes
) -> None:
    """The fast path reads what encode() writes; for any payload it returns what the
    general path returns, or nothing (when the general path refuses it, among others)."""
    msg = Regions(add=add, remove=remove)
    if not any("\\" in r.name or '"' in r.name for r in add + remove):
        assert wire._fast_regions(encode(msg)[HEADER_SIZE:]) == msg
    fast, general = _read_both(payload)
    if fast is not None:
        assert general == fast
        values = [getattr(r, f) for r in fast.add + fast.remove for f in ("addr", "length", "rkey")]
        assert all(type(v) is int for v in values)


@FUZZ
@given(
    add=st.lists(st.integers(0, 40), max_size=30),
    remove=st.lists(st.integers(0, 40), max_size=30),
    max_payload=st.integers(200, 1200),
)
def test_regions_frames_are_packed_in_order_and_fit(
    add: list[int], remove: list[int], max_payload: int
) -> None:
    """Regions with names of random lengths: every frame fits, the frames change the
    receiver as one message would, and no frame could have taken its list's next region."""
    adds = tuple(_region(i, n) for i, n in enumerate(add))
    removes = tuple(_region(100 + i, n) for i, n in enumerate(remove))
    frames = wire.regions_frames(adds, removes, max_payload=max_payload)
    assert all(len(f) - HEADER_SIZE <= max_payload for f in frames)
    start = {(r.rkey, r.addr): r for r in removes}
    assert _apply_all(frames, start, max_payload) == {(r.rkey, r.addr) for r in adds}
    msgs = [expect(wire.decode(f, max_payload=max_payload), Regions) for f in frames]
    if len(frames) > 1:
        lists = [m.remove or m.add for m in msgs]
        assert tuple(r for m in msgs for r in m.remove) == removes
        assert tuple(r for m in msgs for r in m.add) == adds
        for frame, this, after in zip(frames, lists, lists[1:], strict=False):
            if (this[0] in adds) == (after[0] in adds):  # the next region went to a new frame
                grown = len(frame) - HEADER_SIZE + region_size(after[0])
                assert grown > max_payload, (len(frame), region_size(after[0]))
