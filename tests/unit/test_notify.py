"""The notification format: one copy of its limits, a lossless round trip."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl.core import notify
from hixl.errors import ArgumentError

names = st.text(min_size=1, max_size=64).filter(lambda s: "\0" not in s)


@given(names, st.binary(max_size=512))
def test_round_trip(name: str, message: bytes) -> None:
    raw = notify.encode(name, message)
    assert len(raw) <= notify.SLOT_BYTES
    assert notify.decode("10.0.0.1:5000", raw) == notify.Notification(
        "10.0.0.1:5000", name, message
    )


def test_limits() -> None:
    notify.encode("n" * notify.MAX_NAME_CHARS, b"m" * 1024)  # Huawei hixl's 1024 + 1024
    with pytest.raises(ArgumentError, match="1..1024 characters"):
        notify.encode("n" * (notify.MAX_NAME_CHARS + 1))
    with pytest.raises(ArgumentError, match="without NUL"):
        notify.encode("a\0b")
    with pytest.raises(ArgumentError, match="without NUL"):
        notify.encode("")
    with pytest.raises(ArgumentError, match=f"at most {notify.SLOT_BYTES}"):
        notify.encode("n", b"x" * notify.SLOT_BYTES)
    notify.encode("n", b"x" * notify.MAX_MESSAGE_BYTES)


@given(st.binary(max_size=notify.SLOT_BYTES))
def test_decode_never_raises(raw: bytes) -> None:
    note = notify.decode("p", raw)
    if note is not None:
        assert note.name and "\0" not in note.name
        assert notify.encode(note.name, note.message) == raw


@pytest.mark.parametrize("raw", [b"", b"\0msg", b"no-nul", b"\xff\xfe\0x"])
def test_malformed_is_none(raw: bytes) -> None:
    assert notify.decode("p", raw) is None
