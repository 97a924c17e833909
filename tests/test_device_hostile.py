"""Devices trust nothing either: whatever arrives on a device's topics, the device loop refuses
what it cannot use with the reason, keeps running, and its model never turns non-finite from a
message (the outside attacks one by one, then hypothesis over every method's download). With the
server's key it refuses anything unsigned, misaddressed, altered or replayed."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefl.build import build_run
from edgefl.config import RunConfig
from edgefl.device import DeviceLoop
from edgefl.messages import Message, encode
from edgefl.methods import METHODS
from edgefl.sim import Simulation
from edgefl.transport.base import Delivery, DeviceTransport
from edgefl.transport.chunks import split
from edgefl.transport.envelope import Envelope, pack, unpack
from edgefl.transport.signing import EVERYONE, Signer, Verifier
from tests.conftest import flip_last, method_config

FED = "hostile"
BOUNDED = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Outbox(DeviceTransport):
    """The device's side of a wire, kept in a list: what the device sends is what the test reads."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.clock = 0.0

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def receive(self, timeout_s: float):
        return None

    def now(self) -> float:
        return self.clock


def _setup(method: str):
    """A device of a tiny real run of ``method`` and the download the real server half sends it
    in round 2 (after one real round), to mutate."""
    raw = method_config(method, rounds=3)
    raw["network"] = {"federation": FED}
    cfg = RunConfig.model_validate(raw)
    sim = Simulation(cfg, show_progress=False)
    sim.run_round(1)
    good = sim.server.downlink(2, "client-0")
    parts = build_run(cfg)
    loop = DeviceLoop(parts.client("client-0"), Outbox(), FED, cfg.network, parts.x_test, parts.y_test)
    return cfg, loop, good


def _download(message: Message | None, round_no: int = 2, kind: str = "download") -> Delivery:
    body, codec = (encode(message), "safetensors") if message is not None else (b"", "none")
    env = Envelope(kind, FED, round_no, "server", body, model_version=round_no, codec=codec, extra={"info": {"run": "r1"}})
    return Delivery("message", "server", pack(env))


def _finite(loop: DeviceLoop) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in loop.client.model.state_dict().values() if t.is_floating_point())


def _uploads(loop: DeviceLoop) -> list[Envelope]:
    return [e for e in (unpack(d, 1 << 30) for d in loop.transport.sent) if e.type == "upload"]


def _state(loop: DeviceLoop) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loop.client.model.state_dict().items()}


SENDS_TENSORS = sorted(m for m in METHODS if m not in ("local", "fedcvae"))


def _mutations(good: Message) -> list[tuple[str, dict[str, torch.Tensor]]]:
    names = sorted(good.tensors)
    first = names[0]
    floats = [n for n in names if good.tensors[n].is_floating_point()]
    f = floats[0]
    out = [
        ("a tensor missing", {k: v for k, v in good.tensors.items() if k != names[-1]}),
        ("an extra tensor", {**good.tensors, "extra.weight": torch.zeros(3)}),
        ("a reshaped tensor", {**good.tensors, first: torch.zeros(7, 3, dtype=good.tensors[first].dtype)}),
        ("all NaN", {k: (torch.full_like(v, math.nan) if v.is_floating_point() else v) for k, v in good.tensors.items()}),
        ("an infinity", {**good.tensors, f: good.tensors[f].clone().fill_(math.inf)}),
        ("a huge value", {**good.tensors, f: good.tensors[f].clone().fill_(1e30)}),
        ("an integer where floats go", {**good.tensors, f: torch.zeros(good.tensors[f].shape, dtype=torch.int64)}),
    ]
    return out


@pytest.mark.parametrize("method", SENDS_TENSORS)
def test_a_broken_download_is_refused_and_the_good_one_still_trains(method):
    cfg, loop, good = _setup(method)
    assert good is not None and good.tensors
    before = _state(loop)
    for what, tensors in _mutations(good):
        loop.handle(_download(Message(good.kind, 2, "server", tensors, good.meta)))
        assert not _uploads(loop), f"{method}: trained on a download with {what}"
        assert _finite(loop), f"{method}: {what} made the model non-finite"
        assert all(torch.equal(before[k], v) for k, v in loop.client.model.state_dict().items()), f"{method}: {what} changed the model"
    loop.handle(_download(Message("not-a-kind", 2, "server", good.tensors, good.meta)))
    assert not _uploads(loop) and loop.refused >= len(_mutations(good)) + 1
    # the evaluate request path refuses the same way
    loop.handle(_download(Message(good.kind, 2, "server", _mutations(good)[3][1], good.meta), kind="evaluate"))
    assert not _uploads(loop) and _finite(loop)
    loop.handle(_download(good))  # the real download: the device was never stopped
    uploads = _uploads(loop)
    assert len(uploads) == 1 and uploads[0].round == 2 and _finite(loop)


def test_fedhe_attacks_of_the_outside_trial():
    _, loop, good = _setup("fedhe")
    no_mask = {"logits": good.tensors["logits"]}
    wrong = {"logits": torch.zeros(3, 3), "mask": torch.ones(3, dtype=torch.bool)}
    nan = {"logits": torch.full_like(good.tensors["logits"], math.nan), "mask": good.tensors["mask"]}
    for tensors in (no_mask, wrong, nan):
        loop.handle(_download(Message("class_logits", 2, "server", tensors)))
        loop.handle(_download(Message("class_logits", 2, "server", tensors), kind="evaluate"))
    assert not _uploads(loop) and _finite(loop) and loop.refused == 6
    assert loop.client.server_logits is None  # nothing of them was applied


names = st.sampled_from(["logits", "mask", "weight", "bias", "class.features", "fc.weight", "x"])
tensors_st = st.dictionaries(names, st.tuples(st.lists(st.integers(0, 12), min_size=0, max_size=3),
                                              st.sampled_from([torch.float32, torch.int64, torch.bool, torch.float16]),
                                              st.sampled_from([0.0, 1.0, -3e38, math.nan, math.inf, 1e7])), max_size=4)


@pytest.fixture(scope="module")
def fedhe_device():
    return _setup("fedhe")


_DEVICES: dict[str, tuple] = {}


@pytest.fixture(params=SENDS_TENSORS)
def any_device(request):
    """A device of every method that receives tensors (built once per method)."""
    if request.param not in _DEVICES:
        _DEVICES[request.param] = _setup(request.param)
    return _DEVICES[request.param]


@BOUNDED
@given(tensors=tensors_st, kind=st.sampled_from(["class_logits", "weights", "head", "class_features"]), evaluate=st.booleans())
def test_no_download_stops_a_device_or_poisons_its_model(any_device, tensors, kind, evaluate):
    _, loop, good = any_device
    if tensors and good is not None and good.tensors:  # half the time, names the method really uses
        real = sorted(good.tensors)
        tensors = {real[i % len(real)] if i % 2 else name: spec for i, (name, spec) in enumerate(tensors.items())}
    built = {name: torch.full(shape, fill).to(dtype) if dtype != torch.bool else torch.zeros(shape, dtype=torch.bool)
             for name, (shape, dtype, fill) in tensors.items()}
    loop.handle(_download(Message(kind, 50, "server", built), round_no=50, kind="evaluate" if evaluate else "download"))
    loop.handled.clear()
    loop.served.pop(50, None)
    assert _finite(loop)


@BOUNDED
@given(data=st.binary(max_size=600), channel=st.sampled_from(["message", "announcement"]))
def test_no_bytes_stop_a_device(fedhe_device, data, channel):
    _, loop, _ = fedhe_device
    loop.handle(Delivery(channel, "server", data))
    assert not loop.finished


def test_stale_partial_downloads_are_dropped_on_the_device():
    _, loop, good = _setup("fedavg")
    loop.net = loop.net.model_copy(update={"stale_upload_s": 0.05})
    from edgefl.transport.chunks import Reassembler

    loop.reassembler = Reassembler(loop.net.max_message_bytes, 0.05)
    env = Envelope("download", FED, 2, "server", encode(good), model_version=2, codec="safetensors")
    pieces = split(env, 4096, 4096)
    assert len(pieces) > 2
    loop.handle(Delivery("message", "server", pieces[0]))
    assert loop.reassembler.partial
    end = time.monotonic() + 5
    while loop.reassembler.partial and time.monotonic() < end:
        time.sleep(0.06)
        loop.tick()
    assert not loop.reassembler.partial


# --- signing ------------------------------------------------------------------------------------------
def _signed_loop(method: str = "fedhe"):
    cfg, loop, good = _setup(method)
    signer = Signer.from_seed(bytes(range(32)))
    loop.verifier = Verifier.from_hex(signer.public_hex())
    return loop, good, signer


def _signed(signer: Signer, data: bytes, to: str = "client-0") -> bytes:
    return signer.sign(data, to)


def test_with_the_servers_key_only_its_signed_messages_for_this_device_are_taken():
    loop, good, signer = _signed_loop()
    download = _download(good).payload
    forger = Signer.from_seed(bytes(32))
    for data in (download, _signed(forger, download), _signed(signer, download, "client-1"), _signed(signer, download, EVERYONE),
                 flip_last(_signed(signer, download))):
        loop.handle(Delivery("message", "server", data))
    assert not _uploads(loop) and loop.refused == 5
    real = _signed(signer, download)
    loop.handle(Delivery("message", "server", real))
    assert len(_uploads(loop)) == 1
    loop.handled.clear()
    loop.served.clear()
    loop.handle(Delivery("message", "server", real))  # the same signed message again: a replay
    assert len(_uploads(loop)) == 1 and loop.refused == 6


def test_a_forged_end_of_run_does_not_end_a_device_that_knows_the_key():
    loop, _, signer = _signed_loop()
    done = pack(Envelope("round", FED, 3, "server", model_version=3, extra={"info": {"done": True, "run": "r1", "rounds": 3}}))
    loop.run_id = "r1"
    loop.handle(Delivery("announcement", "server", done))  # unsigned: refused
    loop.handle(Delivery("announcement", "server", Signer.from_seed(bytes(32)).sign(done, EVERYONE)))  # another key
    assert not loop.finished
    loop.handle(Delivery("announcement", "server", signer.sign(done, EVERYONE)))
    assert loop.finished


def test_a_chunked_signed_download_is_taken_when_every_chunk_verifies():
    loop, good, signer = _signed_loop("fedavg")
    env = Envelope("download", FED, 2, "server", encode(good), model_version=2, codec="safetensors", extra={"info": {"run": "r1"}})
    pieces = [signer.sign(p, "client-0") for p in split(env, 8192, 8192)]
    assert len(pieces) > 1
    tampered = bytearray(pieces[0])
    tampered[-70] ^= 1
    loop.handle(Delivery("message", "server", bytes(tampered)))
    assert not loop.reassembler.partial  # refused before reassembly
    for p in pieces:
        loop.handle(Delivery("message", "server", p))
    assert len(_uploads(loop)) == 1 and _finite(loop)


def test_a_flood_of_server_refusals_on_a_devices_topic_is_logged_within_budget(fedhe_device, caplog):
    """The server answers every forged upload on a device's topic with a nack the device cannot
    match: the device logged each one, and a device whose stderr was a pipe nobody read blocked on
    a full pipe (the soak caught it). They are logged as refusals are: a few a minute, then a count."""
    import logging

    from edgefl.device import REFUSALS_LOGGED

    _, loop, _ = fedhe_device
    nack = Delivery("message", "server", pack(Envelope("nack", FED, 1, "server", model_version=1, extra={"reason": "bad magic"})))
    with caplog.at_level(logging.WARNING, logger="edgefl.device"):
        for _ in range(500):
            loop.handle(nack)
        shown = [r for r in caplog.records if "the server refused a message" in r.getMessage()]
        assert len(shown) == REFUSALS_LOGGED
        loop.transport.clock += 61
        loop.handle(nack)
    assert any(f"{500 - REFUSALS_LOGGED} more refusals from the server" in r.getMessage() for r in caplog.records)
