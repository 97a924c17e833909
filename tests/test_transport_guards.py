"""What bounds one sender's cost to the server: partial chunked uploads held within a per-device and
a total byte budget, never older than an age limit however they trickle, slices of at least 4 KiB,
a bounded memory of finished uploads, the one upload id rule; and the warning for a broker anyone
on the network can read and write."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefl.errors import PayloadError
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import MIN_CHUNK_BYTES, Envelope, unpack
from edgefl.transport.link import BrokerAddress, is_loopback, open_broker_warning

KIB = 1024
LIMIT = 64 * KIB  # the largest message: a sender may hold 128 KiB of partials, everybody 256 KiB


def chunk(sender: str, upload_id: str, seq: int, count: int = 16, size: int = 4 * KIB) -> Envelope:
    """A slice of a declared ``count`` x 4 KiB upload that never completes (its SHA-256 is made up)."""
    return Envelope("chunk", "fed", 1, sender, b"x" * size, codec="none",
                    extra={"chunk": {"upload_id": upload_id, "seq": seq, "count": count, "total_length": count * 4 * KIB,
                                     "total_sha256": "0" * 64}})


def whole_upload(sender: str = "client-0", size: int = 10 * KIB) -> list[Envelope]:
    env = Envelope("upload", "fed", 1, sender, b"w" * size, codec="none")
    return [unpack(p, 1 << 20) for p in split(env, chunk_bytes=4 * KIB, threshold=0)]


def test_one_sender_cannot_hold_more_than_twice_the_largest_message():
    r = Reassembler(LIMIT)
    for upload in range(2):
        for seq in range(15):
            r.add(chunk("client-0", f"u{upload}", seq))
    assert r.held_by("client-0") == 120 * KIB
    for seq in range(2):
        r.add(chunk("client-0", "u2", seq))
    with pytest.raises(PayloadError, match=r"client-0's unfinished uploads would hold 135168 bytes, over its budget of 131072"):
        r.add(chunk("client-0", "u2", 2))
    assert r.held_by("client-0") == 128 * KIB and r.held_bytes == 128 * KIB
    r.add(chunk("client-1", "u0", 0))  # another device's budget is its own


def test_all_senders_together_stay_within_the_total_budget():
    r = Reassembler(LIMIT, max_partial_bytes=122 * KIB)
    for seq in range(15):
        r.add(chunk("client-0", "u", seq))
        r.add(chunk("client-1", "u", seq))
    with pytest.raises(PayloadError, match=r"would hold 126976 bytes in all, over the budget of 124928 \(network.max_partial_bytes_total\)"):
        r.add(chunk("client-2", "u", 0))
    assert "client-2" not in {k[0] for k in r.partial}  # a refused first chunk leaves no partial behind
    r.forget("client-0")
    assert r.held_bytes == 60 * KIB
    r.add(chunk("client-2", "u", 0))


def test_a_partial_fed_one_chunk_at_a_time_is_dropped_at_its_age_limit():
    r = Reassembler(LIMIT, stale_s=120, max_age_s=300)
    r.add(chunk("client-0", "drip", 0))
    r.add(chunk("client-0", "drip", 1))  # a chunk now and then: never stale
    assert r.collect_stale() == []
    r.partial[("client-0", "drip")].started -= 301
    assert r.collect_stale() == [("client-0", "drip", list(range(16)), True)]
    assert r.partial == {} and r.held_bytes == 0 and r.held_by("client-0") == 0


def test_slices_other_than_the_last_carry_at_least_4_kib():
    r = Reassembler(LIMIT)
    with pytest.raises(PayloadError, match=f"chunk 0 of 16 of upload u carries 10 bytes: every chunk but the last carries at least {MIN_CHUNK_BYTES}"):
        r.add(chunk("client-0", "u", 0, size=10))
    r.add(chunk("client-0", "u", 15, size=10))  # the last may be short
    assert r.held_bytes == 10


def test_the_upload_id_must_be_the_message_id_inside():
    (one,) = whole_upload(size=1000)
    assert one.extra["chunk"]["count"] == 1
    one.extra["chunk"] = {**one.extra["chunk"], "upload_id": "somebody-elses-id"}
    with pytest.raises(PayloadError, match="the envelope inside has message_id"):
        Reassembler(LIMIT).add(one)
    pieces = whole_upload()
    assert len(pieces) == 3 and all(p.extra["chunk"]["upload_id"] == pieces[0].extra["chunk"]["upload_id"] for p in pieces)
    r = Reassembler(LIMIT)
    assert [r.add(p) is not None for p in pieces] == [False, False, True]
    assert r.held_bytes == 0 and r.partial == {}


def test_finished_uploads_are_remembered_up_to_a_bound():
    r = Reassembler(LIMIT, max_completed=8)
    for _ in range(20):
        (one,) = whole_upload(size=100)
        assert r.add(one) is not None
    assert len(r.completed) == 8
    assert r.add(one) is None  # the latest are still known: a late duplicate starts nothing


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["u1", "u2", "u3", "u4", "u5"]),
                          st.integers(0, 15), st.sampled_from([10, 4 * KIB, 6 * KIB])), max_size=80),
       st.booleans())
def test_the_budgets_hold_whatever_arrives(chunks, drop_stale):
    r = Reassembler(LIMIT, max_partial_bytes=160 * KIB, max_age_s=0.0 if drop_stale else None)
    for sender, upload_id, seq, size in chunks:
        try:
            r.add(chunk(sender, upload_id, seq, size=size))
        except PayloadError:
            pass
        if drop_stale:
            r.collect_stale()
        assert r.held_bytes == sum(p.size for p in r.partial.values()) <= r.max_partial_bytes
        for sender_ in "abc":
            assert r.held_by(sender_) == sum(p.size for k, p in r.partial.items() if k[0] == sender_) <= r.max_sender_bytes
        assert sum(1 for k in r.partial if k[0] == sender) <= r.max_partial_per_sender


@pytest.mark.parametrize("url, username, warned", [
    ("mqtt://broker.example.org:1883", None, True),
    ("mqtt://192.168.1.10", "", True),
    ("mqtt://192.168.1.10", "edgefl-server", False),
    ("mqtts://broker.example.org:8883", None, False),
    ("mqtt://127.0.0.1:1883", None, False),
    ("mqtt://127.8.0.1:1883", None, False),
    ("mqtt://localhost:1883", None, False),
    ("mqtt://[::1]:1883", None, False),
])
def test_an_anonymous_plain_broker_off_loopback_is_warned_about(url, username, warned):
    warning = open_broker_warning(BrokerAddress.parse(url), username)
    assert (warning is not None) == warned
    if warned:
        assert "anyone who can reach the broker can read every upload and forge messages" in warning and "docs/deploy.md" in warning


def test_the_warning_is_logged_where_server_and_device_connect(caplog):
    from edgefl.transport.mqtt import _warn_if_open

    with caplog.at_level(logging.WARNING, logger="edgefl.transport"):
        _warn_if_open(BrokerAddress.parse("mqtt://10.1.2.3:1883"), None)
        _warn_if_open(BrokerAddress.parse("mqtt://127.0.0.1:1883"), None)
    assert len(caplog.records) == 1 and "mqtt://10.1.2.3:1883" in caplog.records[0].getMessage()
    assert is_loopback("LOCALHOST") and not is_loopback("localhost.example.org")
