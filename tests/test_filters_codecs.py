"""The upload codecs among the filters: ``quantize`` (8/16-bit codes with scales) and ``topk``
(sparse weight changes with error feedback). Small tensors worked by hand, every message through
the wire codec (the filtered message is a valid message), and hostile uploads refused with their
reason."""

from __future__ import annotations

import re

import pytest
import torch
from pydantic import ValidationError

from edgefl.errors import PayloadError
from edgefl.filters import FILTERS, Filter, FilterOptions, get_filter, register_filter
from edgefl.filters.quantize import CODES, META_KEY, SCALES, QuantizeFilter, QuantizeOptions, dequantize_tensor, quantize_tensor
from edgefl.filters.topk import INDEX, VALUE, TopKFilter, TopKOptions
from edgefl.messages import Message, decode, encode
from edgefl.methods import METHODS, get_method


def wire(message: Message) -> Message:
    return decode(encode(message))


def pair(cls: type[Filter], seed: int = 0, device: str = "dev-0", **options) -> tuple[Filter, Filter]:
    """(device side, server side) instances with the same options."""
    opts = cls.Options(**options)
    return cls(opts, side="device", seed=seed, device=device), cls(opts, side="server", seed=seed)


# --- quantize ---------------------------------------------------------------------------------------

def test_quantize_8_bit_per_tensor_by_hand():
    x = torch.tensor([1.27, -0.64, 0.0, 0.004, 0.3])
    codes, scale = quantize_tensor(x, 8, None)
    assert codes.dtype == torch.int8 and codes.tolist() == [127, -64, 0, 0, 30]
    assert scale.shape == (1,) and scale.item() == pytest.approx(0.01)
    back = dequantize_tensor(codes, scale, None)
    assert float((back - x).abs().max()) <= scale.item() / 2 * (1 + 1e-6)


def test_quantize_per_block_has_one_scale_per_block_and_the_last_one_partial():
    x = torch.cat([torch.full((16,), 0.5), torch.linspace(-2.54, 2.54, 16), torch.tensor([0.0] * 6 + [-0.127])])
    codes, scale = quantize_tensor(x.view(3, 13), 8, 16)
    assert codes.shape == (3, 13) and scale.shape == (3,)  # 39 values in blocks of 16: 16, 16, 7
    assert scale.tolist() == pytest.approx([0.5 / 127, 0.02, 0.001])
    flat = codes.reshape(-1)
    assert flat[:16].tolist() == [127] * 16 and flat[16].item() == -127 and flat[31].item() == 127
    assert flat[32:].tolist() == [0] * 6 + [-127]
    back = dequantize_tensor(codes, scale, 16).reshape(-1)
    per_value_scale = scale.repeat_interleave(16)[:39]
    assert bool(((back - x).abs() <= per_value_scale / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("bits,block", [(8, None), (8, 64), (16, None), (16, 64)])
def test_quantize_error_is_at_most_half_a_step(bits, block):
    x = torch.randn(37, 29, generator=torch.Generator().manual_seed(bits)) * torch.logspace(-3, 1, 29)  # columns of very different size
    codes, scale = quantize_tensor(x, bits, block)
    assert codes.dtype == (torch.int8 if bits == 8 else torch.int16)
    step = scale.repeat_interleave(block or x.numel())[: x.numel()].view(x.shape)
    err = (dequantize_tensor(codes, scale, block) - x).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-12).all())
    assert float(err.max()) <= float(x.abs().max()) / (2 ** (bits - 1) - 1) / 2 * (1 + 1e-5)


def test_a_zero_tensor_has_zero_scale_and_comes_back_zero():
    codes, scale = quantize_tensor(torch.zeros(5), 8, None)
    assert scale.tolist() == [0.0] and codes.tolist() == [0] * 5
    assert dequantize_tensor(codes, scale, None).tolist() == [0.0] * 5


def _upload(**extra: torch.Tensor) -> Message:
    g = torch.Generator().manual_seed(1)
    return Message("class_features", 3, "dev-0", {
        "conv.weight": torch.randn(8, 4, 3, 3, generator=g), "fc.bias": torch.randn(10, generator=g),
        "bn.num_batches_tracked": torch.tensor(5), "class.classes": torch.tensor([0, 2, 7]),
        "class.counts": torch.tensor([4, 1, 9]), "mask": torch.tensor([True, False]), **extra,
    }, {"num_samples": 14, "arch": "cnn"})


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_quantize_filter_through_the_wire_restores_every_tensor(bits, granularity):
    device, server = pair(QuantizeFilter, bits=bits, granularity=granularity, block_size=32)
    sent = _upload(empty=torch.zeros(0, 3))
    out = device.upload_out(sent)
    code = torch.int8 if bits == 8 else torch.int16
    assert out.tensors[CODES + "conv.weight"].dtype == code and out.tensors[CODES + "conv.weight"].shape == (8, 4, 3, 3)
    assert out.tensors[SCALES + "conv.weight"].shape == ((1,) if granularity == "tensor" else (9,))  # 288 values / 32
    for name in ("bn.num_batches_tracked", "class.classes", "class.counts", "mask", "empty"):  # not quantised
        assert out.tensors[name] is sent.tensors[name]
    assert "conv.weight" not in out.tensors and META_KEY not in out.meta and out.message_id == sent.message_id
    assert sent.tensors["conv.weight"].dtype == torch.float32 and "conv.weight" in sent.tensors  # the original is untouched
    back = server.upload_in(wire(out))
    assert set(back.tensors) == set(sent.tensors) and back.meta == sent.meta and back.kind == sent.kind
    for name, t in sent.tensors.items():
        assert back.tensors[name].dtype == t.dtype and back.tensors[name].shape == t.shape
        if t.is_floating_point() and t.numel():
            bound = float(t.abs().max()) / (2 ** (bits - 1) - 1) / 2
            assert float((back.tensors[name] - t).abs().max()) <= bound * (1 + 1e-5)
        else:
            assert torch.equal(back.tensors[name], t)


def test_quantize_saves_the_bytes_it_promises():
    weights = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    dense = len(encode(Message("weights", 0, "d", weights, {"num_samples": 1})))
    for bits, granularity, ratio in ((8, "tensor", 3.9), (8, "block", 3.8), (16, "block", 1.95)):
        device, _ = pair(QuantizeFilter, bits=bits, granularity=granularity)
        size = len(encode(device.upload_out(Message("weights", 0, "d", weights, {"num_samples": 1}))))
        assert dense / size > ratio, (bits, granularity, dense / size)


def test_quantize_records_and_restores_a_dtype_other_than_f32():
    device, server = pair(QuantizeFilter)
    sent = Message("weights", 0, "dev-0", {"w": torch.randn(40, dtype=torch.float64), "h": torch.randn(40).half()}, {"num_samples": 1})
    out = device.upload_out(sent)
    assert out.meta[META_KEY] == {"dtypes": {"w": "F64", "h": "F16"}}
    back = server.upload_in(wire(out))
    assert back.tensors["w"].dtype == torch.float64 and back.tensors["h"].dtype == torch.float16
    assert META_KEY not in back.meta  # consumed: the upload checks never see it


def test_quantize_passes_messages_without_float_tensors_and_non_finite_ones():
    device, server = pair(QuantizeFilter)
    evaluation = Message("evaluation", 2, "dev-0", {}, {"num_samples": 5, "eval_accuracy": 0.5})
    assert server.upload_in(wire(device.upload_out(evaluation))).meta == evaluation.meta
    bad = Message("weights", 0, "dev-0", {"w": torch.tensor([1.0, float("nan")])}, {"num_samples": 1})
    out = device.upload_out(bad)
    assert set(out.tensors) == {"w"}  # sent as it is: the server's upload checks refuse it for what it is


def test_the_device_refuses_a_message_already_using_the_reserved_names():
    device, _ = pair(QuantizeFilter)
    with pytest.raises(ValueError, match="reserves tensor names"):
        device.upload_out(Message("weights", 0, "d", {".quantize/w": torch.zeros(3)}))


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = torch.full((20000,), 0.2537)
    x[0] = 1.27  # scale 0.01: every other value is 25.37 steps
    sent = Message("weights", 4, "dev-0", {"w": x}, {"num_samples": 1})

    def codes(seed=0, device="dev-0", round_no=4):
        f = QuantizeFilter(QuantizeOptions(stochastic_rounding=True, granularity="tensor"), side="device", seed=seed, device=device)
        return f.upload_out(Message("weights", round_no, "dev-0", sent.tensors, sent.meta)).tensors[CODES + "w"]

    first = codes()
    assert torch.equal(first, codes())  # the same (seed, device, round, name): the same bytes
    assert not torch.equal(first, codes(round_no=5)) and not torch.equal(first, codes(device="dev-1"))
    assert not torch.equal(first, codes(seed=1))
    assert set(first[1:].tolist()) == {25, 26}
    assert float(first[1:].double().mean()) == pytest.approx(25.37, abs=0.02)  # 4 standard errors
    _, server = pair(QuantizeFilter, stochastic_rounding=True, granularity="tensor")
    f = QuantizeFilter(QuantizeOptions(stochastic_rounding=True, granularity="tensor"), side="device", seed=0, device="dev-0")
    back = server.upload_in(wire(f.upload_out(sent))).tensors["w"]
    assert float((back - x).abs().max()) < 0.01  # within one step


def _quantized() -> Message:
    device, _ = pair(QuantizeFilter, block_size=16)
    return wire(device.upload_out(Message("weights", 1, "dev-0", {"w": torch.randn(40), "n": torch.tensor(3)}, {"num_samples": 1})))


def _set(name, value):
    return lambda m: m.tensors.__setitem__(name, value)


@pytest.mark.parametrize("tamper,reason", [
    (lambda m: m.tensors.pop(SCALES + "w"), "no scales"),
    (lambda m: m.tensors.pop(CODES + "w"), "scales without codes"),
    (lambda m: m.tensors.__setitem__(CODES + "w", m.tensors[CODES + "w"].to(torch.int16)), "codes are I16, bits = 8 sends I8"),
    (lambda m: m.tensors.__setitem__(SCALES + "w", m.tensors[SCALES + "w"].double()), "1-D F32"),
    (lambda m: m.tensors.__setitem__(SCALES + "w", m.tensors[SCALES + "w"].view(1, 3)), "1-D F32"),
    (lambda m: m.tensors.__setitem__(SCALES + "w", torch.ones(4)), "4 scales for 40 values, one per 16 values makes 3"),
    (lambda m: m.tensors.__setitem__(CODES + "w", m.tensors[CODES + "w"][:30]), "3 scales for 30 values"),
    (_set(SCALES + "w", torch.tensor([0.1, float("nan"), 0.1])), "NaN or Inf"),
    (_set(SCALES + "w", torch.tensor([0.1, float("inf"), 0.1])), "NaN or Inf"),
    (_set(SCALES + "w", torch.tensor([0.1, -0.1, 0.1])), "negative"),
    (_set(SCALES + "w", torch.tensor([0.1, 3e37, 0.1])), "overflows F32"),
    (_set(CODES + "w", torch.full((40,), -128, dtype=torch.int8)), "codes outside [-127, 127]"),
    (_set(CODES + "w", torch.zeros(0, dtype=torch.int8)), "empty"),
    (_set("w", torch.zeros(40)), "both as it is and quantised"),
    (_set(".quantize.zero/w", torch.zeros(1)), "not a name the quantize filter sends"),
    (_set(".quantizex", torch.zeros(1)), "not a name the quantize filter sends"),
    (_set(CODES + SCALES + "x", torch.zeros(3, dtype=torch.int8)), "must name a tensor outside"),
    (_set(CODES, torch.zeros(3, dtype=torch.int8)), "must name a tensor outside"),
    (lambda m: m.meta.__setitem__(META_KEY, "F64"), "must be a table"),
    (lambda m: m.meta.__setitem__(META_KEY, {"dtypes": {"w": "I64"}}), "records dtype 'I64'"),
    (lambda m: m.meta.__setitem__(META_KEY, {"dtypes": {"w": "F64"}, "x": 1}), "must be"),
    (lambda m: m.meta.__setitem__(META_KEY, {"dtypes": {"n": "F64"}}), "tensors that were not quantised"),
])
def test_quantize_refuses_hostile_uploads_with_the_reason(tamper, reason):
    _, server = pair(QuantizeFilter, block_size=16)
    message = _quantized()
    server.upload_in(message)  # untampered: accepted
    tamper(message)
    with pytest.raises(PayloadError, match=re.escape(reason)):
        server.upload_in(wire(message))


def test_quantize_serves_every_method():
    assert all(QuantizeFilter.refusal(QuantizeOptions(), spec) is None for spec in METHODS.values())


def test_quantize_options_are_bounded():
    for bad in ({"bits": 4}, {"granularity": "row"}, {"block_size": 8}, {"block_size": 1 << 20}, {"block_size": 64.0}, {"colour": 1}):
        with pytest.raises(ValidationError):
            QuantizeOptions(**bad)


# --- topk ----------------------------------------------------------------------------------------------

def _download(round_no: int, tensors: dict[str, torch.Tensor]) -> Message:
    return Message("weights", round_no, "server", tensors, {"arch": "cnn"})


def _send(server: Filter, device: Filter, device_id: str, message: Message) -> Message:
    """The server's download through both halves of the filter and the wire."""
    return device.download_in(wire(server.download_out(device_id, message)))


def test_topk_sends_the_k_largest_changes_and_keeps_the_rest():
    device, server = pair(TopKFilter, k=2, min_numel=4)
    ref = torch.arange(8, dtype=torch.float32)
    got = _send(server, device, "dev-0", _download(0, {"w": ref}))
    assert "filter.topk" not in got.meta and torch.equal(got.tensors["w"], ref)
    change = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, 0.0, -0.3, 1.0])
    out = device.upload_out(Message("weights", 0, "dev-0", {"w": ref + change}, {"num_samples": 1}))
    assert set(out.tensors) == {INDEX + "w", VALUE + "w"}
    assert out.tensors[INDEX + "w"].tolist() == [1, 3] and out.tensors[INDEX + "w"].dtype == torch.int32
    assert out.tensors[VALUE + "w"].tolist() == pytest.approx([-5.0, 3.0])
    assert device.residual["w"].tolist() == pytest.approx([0.1, 0, 0.2, 0, 0, 0, -0.3, 1.0])
    back = server.upload_in(wire(out))
    assert back.tensors["w"].tolist() == pytest.approx((ref + torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0])).tolist())
    assert "filter.topk" not in back.meta


def test_error_feedback_delivers_every_change_eventually():
    """Over rounds: the sent changes plus the residual still held add up to the true changes."""
    device, server = pair(TopKFilter, fraction=0.05, min_numel=16)
    g = torch.Generator().manual_seed(0)
    global_w = torch.randn(20, 10, generator=g)
    true_total, sent_total = torch.zeros(20, 10), torch.zeros(20, 10)
    for r in range(3):
        ref = _send(server, device, "dev-0", _download(r, {"w": global_w})).tensors["w"]
        trained = ref + torch.randn(20, 10, generator=g) * 0.1
        out = device.upload_out(Message("weights", r, "dev-0", {"w": trained}, {"num_samples": 1}))
        assert out.tensors[INDEX + "w"].numel() == 10  # ceil(0.05 * 200)
        rebuilt = server.upload_in(wire(out)).tensors["w"]
        true_total += trained - ref
        sent_total += rebuilt - ref
        global_w = rebuilt  # the server's new weights (one device: its upload)
        torch.testing.assert_close(sent_total + device.residual["w"], true_total, atol=1e-5, rtol=0)
    # a dense round (no reference: the device got no download this round) flushes the residual
    trained = global_w + 0.5
    out = device.upload_out(Message("weights", 3, "dev-0", {"w": trained}, {"num_samples": 1}))
    assert set(out.tensors) == {"w"} and "filter.topk" not in out.meta
    torch.testing.assert_close(out.tensors["w"] - global_w, 0.5 + true_total - sent_total, atol=1e-5, rtol=0)
    assert device.residual == {}


def test_topk_residual_survives_a_crash():
    device, server = pair(TopKFilter, k=3, min_numel=16)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, generator=g)
    _send(server, device, "dev-0", _download(0, {"w": w}))
    device.upload_out(Message("weights", 0, "dev-0", {"w": w + torch.randn(64, generator=g)}, {"num_samples": 1}))
    state = device.carry_state()
    assert set(state) == {"residual.w"}
    again = TopKFilter(device.options, side="device", seed=0, device="dev-0")
    again.load_carry_state(state)
    torch.testing.assert_close(again.residual["w"], device.residual["w"])
    trained = {"w": w + torch.randn(64, generator=g)}
    outs = []
    for f in (device, again):
        _send(server, f, "dev-0", _download(1, {"w": w}))
        outs.append(f.upload_out(Message("weights", 1, "dev-0", dict(trained), {"num_samples": 1})))
    assert all(torch.equal(outs[0].tensors[n], outs[1].tensors[n]) for n in outs[0].tensors)


def test_topk_goes_dense_where_it_has_no_reference_or_no_gain():
    device, server = pair(TopKFilter, fraction=0.1, min_numel=32, dense_prefixes=["class."])
    down = {"big": torch.zeros(100), "small": torch.zeros(10), "class.features": torch.zeros(100), "steps": torch.tensor(7)}
    up = {"big": torch.ones(100), "small": torch.ones(10), "class.features": torch.ones(100), "steps": torch.tensor(8),
          "new": torch.ones(100), "reshaped": torch.ones(10, 10)}
    # first round, no download yet: everything dense
    first = device.upload_out(Message("weights", 0, "dev-0", dict(up), {"num_samples": 1}))
    assert set(first.tensors) == set(up) and "filter.topk" not in first.meta
    _send(server, device, "dev-0", _download(1, {**down, "reshaped": torch.zeros(100)}))
    out = device.upload_out(Message("weights", 1, "dev-0", dict(up), {"num_samples": 1}))
    assert set(out.tensors) == {INDEX + "big", VALUE + "big", "small", "class.features", "steps", "new", "reshaped"}
    assert server.upload_in(wire(out)).tensors["steps"].item() == 8
    dense_k = pair(TopKFilter, fraction=0.5, min_numel=32)  # half the values sparse costs as much as dense
    _send(dense_k[1], dense_k[0], "dev-0", _download(0, down))
    assert "big" in dense_k[0].upload_out(Message("weights", 0, "dev-0", dict(up), {"num_samples": 1})).tensors


def test_a_reference_from_another_round_or_changed_on_the_way_is_not_used():
    device, server = pair(TopKFilter, k=1, min_numel=4)
    _send(server, device, "dev-0", _download(0, {"w": torch.zeros(8)}))
    assert set(device.upload_out(Message("weights", 1, "dev-0", {"w": torch.ones(8)})).tensors) == {"w"}
    tagged = wire(server.download_out("dev-0", _download(2, {"w": torch.zeros(8)})))
    tagged.tensors["w"] = tagged.tensors["w"] + 1e-3  # a later filter in the chain changed the download
    device.download_in(tagged)
    assert set(device.upload_out(Message("weights", 2, "dev-0", {"w": torch.ones(8)})).tensors) == {"w"}


def test_the_server_keeps_one_clone_per_distinct_tensor_and_drops_old_rounds():
    _, server = pair(TopKFilter, k=1, min_numel=4)
    shared, own = torch.zeros(16), torch.ones(16)
    server.download_out("a", _download(0, {"w": shared, "v": own}))
    server.download_out("b", _download(0, {"w": shared, "v": own.clone()}))
    a, b = server.sent["a"].tensors, server.sent["b"].tensors
    assert a["w"] is b["w"] and a["w"] is not shared and a["w"].data_ptr() != shared.data_ptr()
    assert a["v"] is not b["v"] and torch.equal(a["v"], b["v"])
    shared.add_(1.0)  # the server half changes its tensor in place between two sends
    server.download_out("c", _download(0, {"w": shared}))
    assert server.sent["c"].tensors["w"] is not a["w"] and float(a["w"].sum()) == 0.0  # "a" keeps what it was sent
    assert server.sent["c"].digest != server.sent["a"].digest
    server.download_out("a", _download(1, {"w": shared}))
    assert set(server.sent) == {"a", "b", "c"}  # round 0 is the previous round: kept for late uploads
    server.download_out("a", _download(2, {"w": shared}))
    assert set(server.sent) == {"a"}  # b and c were last sent round 0: dropped


def _sparse_upload() -> tuple[Filter, Message]:
    device, server = pair(TopKFilter, k=3, min_numel=8)
    _send(server, device, "dev-0", _download(5, {"w": torch.zeros(10), "n": torch.tensor(1)}))
    out = device.upload_out(Message("weights", 5, "dev-0", {"w": torch.arange(10.0), "n": torch.tensor(2)}, {"num_samples": 1}))
    return server, wire(out)


@pytest.mark.parametrize("tamper,reason", [
    (_set(INDEX + "w", torch.tensor([7, 8, 10], dtype=torch.int32)), "an index outside 0..9"),
    (_set(INDEX + "w", torch.tensor([-1, 8, 9], dtype=torch.int32)), "an index outside 0..9"),
    (_set(INDEX + "w", torch.tensor([7, 7, 9], dtype=torch.int32)), "strictly increasing"),
    (_set(INDEX + "w", torch.tensor([9, 8, 7], dtype=torch.int32)), "strictly increasing"),
    (_set(INDEX + "w", torch.tensor([7, 8, 9])), "1-D I32"),
    (_set(INDEX + "w", torch.tensor([[7, 8, 9]], dtype=torch.int32)), "1-D I32"),
    (_set(INDEX + "w", torch.tensor([8, 9], dtype=torch.int32)), "2 indices and 3 values, the options keep 3"),
    (_set(VALUE + "w", torch.tensor([1.0, 2.0, 3.0, 4.0])), "3 indices and 4 values"),
    (_set(VALUE + "w", torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)), "1-D F32"),
    (_set(VALUE + "w", torch.tensor([1.0, float("nan"), 3.0])), "NaN or Inf"),
    (lambda m: m.tensors.pop(VALUE + "w"), "indices without values"),
    (lambda m: m.tensors.pop(INDEX + "w"), "values without indices"),
    (_set(".topk.extra/w", torch.zeros(1)), "not a name the topk filter sends"),
    (lambda m: m.tensors.update({INDEX + "x": torch.tensor([1], dtype=torch.int32), VALUE + "x": torch.ones(1)}),
     "not a tensor of the weights sent"),
    (_set("w", torch.zeros(10)), "both dense and sparse"),
    (lambda m: m.meta.pop("filter.topk"), "need meta 'filter.topk'"),
    (lambda m: m.meta.__setitem__("filter.topk", {"ref": "0" * 32}), "other than the last ones sent"),
    (lambda m: m.meta.__setitem__("filter.topk", {"ref": "x"}), "need meta"),
    (lambda m: m.meta.__setitem__("filter.topk", ["ref"]), "must be a table"),
    (lambda m: setattr(m, "sender", "dev-9"), "holds no weights this server sent"),
])
def test_topk_refuses_hostile_uploads_with_the_reason(tamper, reason):
    server, message = _sparse_upload()
    assert server.upload_in(message).tensors["w"].tolist() == [0.0] * 7 + [7.0, 8.0, 9.0]  # untampered: accepted
    tamper(message)
    with pytest.raises(PayloadError, match=re.escape(reason)):
        server.upload_in(wire(message))


def test_a_hostile_download_tag_is_refused_on_the_device():
    device, _ = pair(TopKFilter)
    for tag in ("abc", {"ref": "zz"}, {"ref": "0" * 32, "more": 1}, {"ref": 5}):
        with pytest.raises(PayloadError, match="filter.topk"):
            device.download_in(Message("weights", 0, "server", {"w": torch.zeros(4)}, {"filter.topk": tag}))


def test_topk_then_quantize_round_trips():
    top_d, top_s = pair(TopKFilter, k=4, min_numel=16)
    q_d, q_s = pair(QuantizeFilter)
    w = torch.randn(64, generator=torch.Generator().manual_seed(3))
    top_d.download_in(q_d.download_in(wire(q_s.download_out("dev-0", top_s.download_out("dev-0", _download(0, {"w": w}))))))
    change = torch.zeros(64)
    change[[3, 9, 40, 63]] = torch.tensor([1.0, -2.0, 0.5, 0.25])
    out = q_d.upload_out(top_d.upload_out(Message("weights", 0, "dev-0", {"w": w + change}, {"num_samples": 1})))
    assert out.tensors[CODES + VALUE + "w"].dtype == torch.int8 and out.tensors[INDEX + "w"].dtype == torch.int32
    back = top_s.upload_in(q_s.upload_in(wire(out))).tensors["w"]
    torch.testing.assert_close(back, w + change, atol=2.0 / 127 / 2 * 1.0001, rtol=0)


@pytest.mark.parametrize("method,words", [
    ("fedhe", "fedhe uploads per-class logits, not weights: top-k sparsifies weight changes; use quantize"),
    ("fedcvae", "CVAE decoders"), ("fedmho", "one-shot"), ("local", "no tensors"),
])
def test_topk_refuses_methods_whose_uploads_are_not_weight_changes(method, words):
    reason = TopKFilter.refusal(TopKOptions(), get_method(method))
    assert reason is not None and words in reason and "quantize" in reason


@pytest.mark.parametrize("method", ["fedavg", "fedin", "felo", "velo", "chfl"])
def test_topk_serves_methods_that_exchange_weights(method):
    assert TopKFilter.refusal(TopKOptions(), get_method(method)) is None


def test_topk_refuses_an_asynchronous_run_and_says_what_serves_it():
    reason = TopKFilter.refusal(TopKOptions(), get_method("fedavg"), mode="async")
    assert reason is not None and 'mode = "sync"' in reason and "quantize" in reason
    from edgefl.config import validate_config
    from edgefl.errors import ConfigError
    from tests.conftest import digits_config

    raw = digits_config("fedavg", mode="async")
    raw["filters"] = [{"name": "topk"}]
    with pytest.raises(ConfigError) as caught:  # the hint offers only filters that serve the run
        validate_config(raw)
    offered = caught.value.hint.split("serves it (")[1].rstrip(")").split(", ")  # other tests may have registered toy filters
    assert "quantize" in offered and "topk" not in offered and "secagg" not in offered


def test_topk_options():
    assert TopKOptions().keep(1000) == 10 and TopKOptions(fraction=0.07).keep(100) == 7 and TopKOptions().keep(3) == 1
    assert TopKOptions(k=50).keep(1000) == 50 and TopKOptions(k=50).keep(20) == 20
    for bad in ({"fraction": 0.0}, {"fraction": 1.5}, {"k": 0}, {"k": 10, "fraction": 0.1}, {"min_numel": 0}):
        with pytest.raises(ValidationError):
            TopKOptions(**bad)


# --- the registry ---------------------------------------------------------------------------------------

def test_both_are_registered_and_a_test_can_register_its_own():
    assert get_filter("quantize") is QuantizeFilter and get_filter("topk") is TopKFilter

    class Halve(Filter):
        name = "halve-test"
        Options = FilterOptions

        def upload_out(self, message: Message) -> Message:
            return Message(message.kind, message.round, message.sender,
                           {n: t / 2 if t.is_floating_point() else t for n, t in message.tensors.items()}, message.meta)

    try:
        register_filter(Halve)
        f = get_filter("halve-test")(FilterOptions(), side="device", seed=0, device="d")
        assert f.upload_out(Message("weights", 0, "d", {"w": torch.ones(2)})).tensors["w"].tolist() == [0.5, 0.5]
    finally:
        FILTERS.pop("halve-test", None)
