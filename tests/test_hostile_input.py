"""Whatever a device or a stranger sends, the decoders raise only PayloadError and the round loop
never raises: the attacks an outside tester found, one by one, then property-based tests
(hypothesis) over envelope, chunk, message decoding and the server's message handler."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefl.config import validate_config
from edgefl.errors import PayloadError
from edgefl.messages import Message, decode, encode
from edgefl.safejson import loads
from edgefl.server.rounds import RoundState
from edgefl.sim import Simulation
from edgefl.transport.base import Delivery
from edgefl.transport.chunks import Reassembler
from edgefl.transport.envelope import PREFIX, Envelope, pack, tensor_manifest, unpack
from tests.conftest import digits_config

LIMIT = 1 << 20
BOUNDED = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def raw_envelope(header: dict | str | bytes, body: bytes = b"") -> bytes:
    """Envelope bytes with an arbitrary header, as an attacker writes them."""
    text = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    return PREFIX.pack(b"EDFL", 1, len(text)) + text + body


def valid_header(body: bytes = b"", **changes) -> dict:
    header = {"type": "upload", "federation": "test-fedavg", "round": 2, "sender": "client-0", "message_id": "m" * 32,
              "reply_to": None, "model_version": 2, "codec": "safetensors",
              "body": {"length": len(body), "sha256": hashlib.sha256(body).hexdigest()}}
    header.update(changes)
    return header


def safetensors_bytes(header: dict | str, data: bytes = b"") -> bytes:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(text)) + text + data


# --- the decoders, attack by attack ---------------------------------------------------------------
def test_a_deeply_nested_header_is_a_refusal_not_a_recursion_error():
    with pytest.raises(PayloadError, match="deeper than 32"):
        unpack(raw_envelope("[" * 30_000 + "]" * 30_000), LIMIT)
    with pytest.raises(PayloadError, match="deeper"):
        loads('{"a":' * 50 + "1" + "}" * 50)
    assert loads('{"s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}') == {"s": "[" * 42}  # brackets in strings do not count


def test_huge_integers_and_non_finite_numbers_are_refused():
    with pytest.raises(PayloadError, match="digits"):
        unpack(raw_envelope('{"round": ' + "9" * 5000 + "}"), LIMIT)
    with pytest.raises(PayloadError, match="64 bits"):
        loads(str(2**63))
    for text in ("NaN", "Infinity", "-Infinity", "1e999"):
        with pytest.raises(PayloadError):
            loads(f'{{"x": {text}}}')


def test_safetensors_headers_of_the_wrong_types_are_refused():
    meta = {"edgefl": json.dumps({"format": "edgefl-message/1", "kind": "weights", "round": 1, "sender": "a",
                                  "message_id": "b", "meta": {}})}
    for bad in ({"w": {"dtype": "F32", "shape": [1], "data_offsets": 4}, "__metadata__": meta},
                {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": ["x"]},
                {"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}, "__metadata__": meta},
                {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "__metadata__": meta},
                {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}, "__metadata__": meta},
                {"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, "__metadata__": meta}):
        with pytest.raises(PayloadError):
            decode(safetensors_bytes(bad, b"\0" * 4))


def test_a_chunk_count_beyond_what_its_length_needs_is_refused_before_any_nack_is_built():
    header = valid_header(b"x", type="chunk", codec="none",
                          chunk={"upload_id": "u" * 32, "seq": 0, "count": 20000, "total_length": 100, "total_sha256": "0" * 64})
    with pytest.raises(PayloadError, match="20000 chunks for 100 bytes"):
        unpack(raw_envelope(header, b"x"), LIMIT)


def test_a_bad_body_hash_is_refused_with_the_message_id_to_answer():
    data = raw_envelope(valid_header(b"abc"), b"abd")
    with pytest.raises(PayloadError) as caught:
        unpack(data, LIMIT)
    assert caught.value.message_id == "m" * 32


# --- the round loop, attack by attack --------------------------------------------------------------
@pytest.fixture(scope="module")
def sim() -> Simulation:
    sim = Simulation(validate_config(digits_config("fedavg", rounds=3)), show_progress=False)
    sim.run_round(1)
    return sim


def open_round(sim: Simulation) -> RoundState:
    """Round 2 open and waiting for every device, as when uploads arrive in a fleet."""
    policy = sim.session.policy
    now = policy.clock.now()
    policy.state = RoundState(2, list(policy.endpoint.device_ids), now, now + 100)
    policy.server.begin_round(2)
    return policy.state


def replies(sim: Simulation, device: str = "client-0") -> list[Envelope]:
    inbox = sim.network._inbox.get(device, [])
    out = [unpack(d.payload, 1 << 24) for d in inbox if d.channel == "message"]
    inbox.clear()
    return out


def upload(message: Message, **changes) -> bytes:
    env = Envelope("upload", "test-fedavg", message.round, message.sender, encode(message), message.message_id,
                   model_version=message.round, codec="safetensors", extra={"tensors": tensor_manifest(message.tensors)})
    for key, value in changes.items():
        setattr(env, key, value)
    return pack(env)


def refusal(sim: Simulation, payload: bytes, device: str = "client-0") -> str:
    open_round(sim)
    replies(sim, device)
    sim.session.endpoint.handle(Delivery("message", device, payload))
    (reply,) = replies(sim, device)
    assert reply.type == "nack", reply
    return reply.extra["reason"]


def weights(sim: Simulation, **meta) -> Message:
    model = sim.clients["client-0"].model
    return Message("weights", 2, "client-0", dict(model.state_dict()), {"num_samples": 5, **meta})


@pytest.mark.parametrize("meta, reason", [
    ({"eval_accuracy": 1.5}, "eval_accuracy must be a number in [0, 1]"),
    ({"eval_accuracy": "0.9"}, "eval_accuracy must be a number in [0, 1]"),
    ({"eval_accuracy": 2}, "eval_accuracy must be a number in [0, 1]"),
    ({"eval_accuracy": 1e300}, "eval_accuracy must be a number in [0, 1]"),
    ({"train_loss": "abc"}, "train_loss must be a finite number"),
    ({"num_samples": 1, "class_counts": [100, 50]}, "class counts sum to 150, more than num_samples = 1"),
    ({"num_samples": 2.5}, "num_samples must be an integer"),
    ({"note": "x" * 300}, "longer than 256"),
    ({"latent": -3}, "latent must be an integer"),
])
def test_device_numbers_out_of_range_are_refused(sim, meta, reason):
    assert reason in refusal(sim, upload(weights(sim, **meta)))


def test_a_whole_number_accuracy_is_a_number_like_any_other(sim):
    open_round(sim)
    replies(sim)
    sim.session.endpoint.handle(Delivery("message", "client-0", upload(weights(sim, eval_accuracy=1))))
    (reply,) = replies(sim)
    assert (reply.type, reply.extra.get("status")) == ("ack", "accepted")


def test_float64_tensors_are_refused_as_the_protocol_says(sim):
    message = weights(sim)
    message.tensors = {k: v.double() if v.is_floating_point() else v for k, v in message.tensors.items()}
    assert "uploads carry F32, I64 or BOOL tensors" in refusal(sim, upload(message))


def test_an_upload_for_a_round_that_has_not_started_is_refused_and_does_not_take_the_slot(sim):
    ahead = weights(sim)
    ahead.round = 3
    assert "round 3 has not started" in refusal(sim, upload(ahead))
    assert sim.session.policy.early == {}


def test_a_stranger_gets_a_nack_on_its_own_topic(sim):
    endpoint = sim.session.endpoint
    sim.network._inbox["client-77"] = []  # the stranger's down topic, as the broker would hold it
    try:
        endpoint.handle(Delivery("message", "client-77", b"anything"))
        endpoint.handle(Delivery("message", "client-77", b"again"))  # rate-limited: one nack
        (reply,) = replies(sim, "client-77")
        assert reply.type == "nack" and "not in this federation's config" in reply.extra["reason"]
    finally:
        del sim.network._inbox["client-77"]


def test_a_retained_upload_is_discarded_without_an_answer(sim):
    open_round(sim)
    replies(sim)
    before = len(sim.session.endpoint.rejections)
    sim.session.endpoint.handle(Delivery("message", "client-0", upload(weights(sim)), retained=True))
    assert replies(sim) == [] and len(sim.session.endpoint.rejections) == before + 1
    assert "retained" in sim.session.endpoint.rejections[-1][1]


def test_refusals_are_kept_as_bounded_counts(sim):
    st = open_round(sim)
    for i in range(3000):
        sim.session.endpoint.handle(Delivery("message", "client-1", f"junk {i}".encode()))
    replies(sim, "client-1")
    summary = st.rejected.summary()
    assert summary["count"] == 3000
    assert len(summary["by_reason"]) <= 10 and summary["by_sender"] == {"client-1": 3000}
    assert len(json.dumps(summary)) < 2000


# --- properties -------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


@BOUNDED
@given(st.binary(max_size=2000))
def test_unpack_of_any_bytes_raises_only_payload_error(data):
    try:
        unpack(data, LIMIT)
    except PayloadError:
        pass


@BOUNDED
@given(st.dictionaries(st.sampled_from(["type", "federation", "round", "sender", "message_id", "reply_to", "model_version",
                                        "codec", "body", "tensors", "chunk", "status", "reason", "missing", "info"]),
                       json_values, max_size=15), st.binary(max_size=64))
def test_unpack_of_any_json_header_raises_only_payload_error(header, body):
    try:
        unpack(raw_envelope(json.dumps(header, allow_nan=True), body), LIMIT)
    except PayloadError:
        pass


@BOUNDED
@given(st.dictionaries(st.sampled_from(["type", "round", "message_id", "reply_to", "model_version", "codec", "chunk",
                                        "missing", "info", "tensors", "status"]), json_values, max_size=6),
       st.binary(max_size=64))
def test_an_almost_valid_header_raises_only_payload_error(changes, body):
    header = valid_header(body, **changes)
    try:
        env = unpack(raw_envelope(header, body), LIMIT)
    except PayloadError:
        return
    if env.type == "chunk":  # a chunk that passed the header checks goes to the reassembler
        try:
            Reassembler(LIMIT).add(env)
        except PayloadError:
            pass


@BOUNDED
@given(st.binary(max_size=600), st.integers(0, 599), st.binary(min_size=1, max_size=8))
def test_decode_of_a_corrupted_message_raises_only_payload_error(prefix_noise, at, patch):
    data = bytearray(encode(Message("weights", 1, "a", {"w": torch.ones(3)}, {"num_samples": 3})))
    at %= len(data)
    data[at : at + len(patch)] = patch
    for candidate in (bytes(data), prefix_noise):
        try:
            decode(candidate)
        except PayloadError:
            pass


@BOUNDED
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4), st.binary(max_size=32))
def test_decode_of_any_safetensors_header_raises_only_payload_error(header, data):
    try:
        decode(safetensors_bytes(json.dumps(header, allow_nan=True), data))
    except PayloadError:
        pass


@BOUNDED
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 9), st.binary(max_size=40)), max_size=12))
def test_the_reassembler_raises_only_payload_error_and_never_holds_more_than_declared(chunks):
    r = Reassembler(1 << 16, max_partial_per_sender=2)
    for seq, count, piece in chunks:
        header = valid_header(piece, type="chunk", codec="none",
                              chunk={"upload_id": f"u{count}", "seq": min(seq, count - 1), "count": count,
                                     "total_length": 4096 * count, "total_sha256": "0" * 64})
        try:
            r.add(unpack(raw_envelope(header, piece), LIMIT))
        except PayloadError:
            pass
        assert all(p.size <= p.total_length for p in r.partial.values())


@BOUNDED
@given(st.one_of(st.binary(max_size=300),
                 st.dictionaries(st.sampled_from(["type", "round", "sender", "codec", "chunk", "tensors", "info", "reply_to"]),
                                 json_values, max_size=4).map(lambda ch: raw_envelope(valid_header(b"", **ch)))),
       st.sampled_from(["client-0", "client-1", "stranger", "client-0\n", "client[/]", "client-1\n[/]"]),
       st.booleans())
def test_the_round_loop_never_raises_and_answers_its_own_devices(sim, printed, payload, device, retained):
    st_ = open_round(sim)
    sim.network._inbox.setdefault("client-0", []).clear()
    sim.session.endpoint.handle(Delivery("message", device, payload, retained=retained))
    if device == "client-0" and not retained:
        answers = replies(sim)
        assert answers and answers[-1].type in ("nack", "ack")
    assert st_.round == 2
    assert printed[1] == []  # every refusal reached the console printer without breaking it


def test_the_device_loop_drops_whatever_malformed_the_network_brings(sim):
    """A device never dies of a message: junk, a download whose body does not decode, bad chunks."""
    loop = sim.network.loops["client-0"]
    bad_body = Envelope("download", "test-fedavg", 2, "server", b"not safetensors", codec="safetensors")
    chunk = Envelope("chunk", "test-fedavg", 2, "server", b"z", codec="none",
                     extra={"chunk": {"upload_id": "u1", "seq": 0, "count": 1, "total_length": 1, "total_sha256": "0" * 64}})
    for payload in (b"junk", pack(bad_body), pack(chunk), raw_envelope("[" * 40 + "]" * 40)):
        loop.handle(Delivery("message", "server", payload))


# --- untrusted strings on the console ---------------------------------------------------------------
HOSTILE_TEXT = ["[/]", "[bold]x[/bold]", "a\nrejected from client-1: FAKE", "\x1b[2J", "x\\"]


@pytest.fixture()
def printed(sim):
    """The console printer of `edgefl server` and `edgefl fleet` on the round loop's events, writing
    into a buffer. A printer that raises is recorded: inside handle() it would only turn into a
    nack ("could not handle this message"), in the round loop's pump it would end the server."""
    import io

    from rich.console import Console

    from edgefl.cli import _fleet_printer

    buffer = io.StringIO()
    printer = _fleet_printer(Console(file=buffer, width=2000, color_system=None), 3, None, 4)
    failures: list[Exception] = []

    def on_event(kind: str, info: dict) -> None:
        try:
            printer(kind, info)
        except Exception as exc:
            failures.append(exc)
            raise

    endpoint, policy = sim.session.endpoint, sim.session.policy
    before, endpoint.on_event, policy.on_event = endpoint.on_event, on_event, on_event
    yield buffer, failures
    endpoint.on_event = policy.on_event = before


def assert_printed_safely(buffer, failures: list[Exception]) -> str:
    text = buffer.getvalue()
    assert failures == []
    assert not [line for line in text.splitlines() if not line.startswith("  ")], text  # no fake line of its own
    assert "\x1b" not in text
    return text


@pytest.mark.parametrize("name", HOSTILE_TEXT)
def test_a_hostile_tensor_name_is_refused_and_printed_escaped(sim, printed, name):
    message = weights(sim)
    first = next(iter(message.tensors))
    message.tensors = {(name if k == first else k): v for k, v in message.tensors.items()}
    reason = refusal(sim, upload(message))
    assert "could not handle" not in reason
    assert_printed_safely(*printed)


@pytest.mark.parametrize("device", ["client[/]", "client-0\n[/]", "[bold]client", "client-0\x1b[2J"])
def test_a_hostile_device_id_is_counted_and_printed_escaped(sim, printed, device):
    open_round(sim)
    sim.session.endpoint.handle(Delivery("message", device, b"anything"))
    text = assert_printed_safely(*printed)
    assert "is not in this federation's config" in text


@pytest.mark.parametrize("upload_id", ["[/]", "u\nrejected from client-1: FAKE", "[red]u"])
def test_a_stale_partial_with_a_hostile_upload_id_reaches_the_console_escaped(sim, printed, monkeypatch, upload_id):
    """The attack of issue 33: one chunk whose upload id is "[/]", left to go stale, made the
    round loop's pump raise MarkupError and ended the server."""
    open_round(sim)
    endpoint = sim.session.endpoint
    monkeypatch.setattr(endpoint, "reassembler", Reassembler(LIMIT))  # only this test's partial goes stale
    monkeypatch.setattr(endpoint.transport, "receive", lambda timeout_s: None)  # the pump's stale check alone, devices idle
    chunk = Envelope("chunk", "test-fedavg", 2, "client-0", b"z" * 4096, codec="none", model_version=2,
                     extra={"chunk": {"upload_id": upload_id, "seq": 0, "count": 2, "total_length": 8192, "total_sha256": "0" * 64}})
    endpoint.handle(Delivery("message", "client-0", pack(chunk)))
    part = endpoint.reassembler.partial[("client-0", upload_id)]
    part.touched -= endpoint.reassembler.stale_s + 1
    replies(sim)
    endpoint.pump(0)  # raised MarkupError before
    (nack,) = replies(sim)
    assert nack.type == "nack" and nack.reply_to == upload_id and nack.extra["missing"] == [1]
    assert "\n" not in nack.extra["reason"]
    text = assert_printed_safely(*printed)
    assert "went stale" in text


def test_printable_escapes_control_characters_and_bounds_length():
    from edgefl.safetext import console_text, printable

    assert printable("a\nb\x1b[2J\u202e\ud800") == "a\\x0ab\\x1b[2J\\u202e\\ud800"
    assert printable("x" * 400, 300) == "x" * 300 + "..."
    assert printable("client-0") == "client-0" and printable(42) == "42"
    assert console_text("[/]") == "\\[/]"
