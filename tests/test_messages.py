"""The message codec: lossless round trips, and refusal of anything malformed (never pickle)."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import save as st_save

from edgefl.errors import PayloadError
from edgefl.messages import Message, decode, encode


def sample() -> Message:
    return Message(
        "class_logits", 3, "client-1",
        {"logits": torch.randn(4, 10), "classes": torch.tensor([0, 2, 5, 9]), "mask": torch.tensor([True, False])},
        {"num_samples": 120, "class_counts": [1, 2, 3], "arch": "resnet18(width=0.25)"},
    )


def test_round_trip_preserves_everything():
    m = sample()
    back = decode(encode(m))
    assert (back.kind, back.round, back.sender, back.meta, back.message_id) == (m.kind, m.round, m.sender, m.meta, m.message_id)
    for name, t in m.tensors.items():
        assert back.tensors[name].dtype == t.dtype and torch.equal(back.tensors[name], t)


def test_feature_pairs_keep_their_shapes():
    m = Message("feature_pairs", 1, "c", {"s_in": torch.randn(16, 8, 28, 28), "s_out": torch.randn(16, 64)})
    back = decode(encode(m))
    assert back.tensors["s_in"].shape == (16, 8, 28, 28) and back.tensors["s_out"].shape == (16, 64)


def test_empty_message():
    back = decode(encode(Message("status", 0, "server")))
    assert back.tensors == {} and back.kind == "status"


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "truncated"),
        (b"\x01\x02", "truncated"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header claims"),
        (struct.pack("<Q", 50) + b"{}", "truncated"),
        (struct.pack("<Q", 5) + b"{abc}", "not JSON"),
        (pickle.dumps({"weights": [1, 2, 3]}), "header claims|truncated|not JSON"),
    ],
)
def test_malformed_bytes_are_refused(data, match):
    with pytest.raises(PayloadError, match=match):
        decode(data)


def test_foreign_safetensors_is_not_a_message():
    with pytest.raises(PayloadError, match="not an edgefl message"):
        decode(st_save({"w": torch.zeros(3)}))


def test_size_cap_is_checked_before_parsing():
    data = encode(Message("weights", 1, "c", {"w": torch.zeros(1000)}))
    with pytest.raises(PayloadError, match="exceeds"):
        decode(data, max_bytes=100)


def test_offsets_outside_body_are_refused():
    good = encode(Message("weights", 1, "c", {"w": torch.zeros(4)}))
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + n])
    header["w"]["data_offsets"] = [0, 10_000]
    raw = json.dumps(header).encode()
    with pytest.raises(PayloadError, match="outside"):
        decode(struct.pack("<Q", len(raw)) + raw + good[8 + n :])


def test_missing_fields_are_refused():
    meta = {"edgefl": json.dumps({"format": "edgefl-message/1", "kind": "x", "round": "one", "sender": "c", "message_id": "m", "meta": {}})}
    with pytest.raises(PayloadError, match="'round'"):
        decode(st_save({"w": torch.zeros(1)}, metadata=meta))


def test_payload_numbers_counts_scalars():
    assert sample().payload_numbers() == 40 + 4 + 2
