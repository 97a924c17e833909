"""docs/adding-a-method.md, proven: a tiny method written as only its two halves, an options
model and a spec runs in simulation and as a fleet over a real mosquitto with the same numbers;
and the method contract checks itself (message kinds, abstract halves)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from edgefl.algorithms import ClientHalf, MethodOptions
from edgefl.config import RunConfig
from edgefl.messages import MESSAGE_KINDS, RUNNER_KINDS, Message
from edgefl.methods import METHODS, MethodSpec, register_method
from edgefl.server.methods import Receipt, ServerHalf
from tests.conftest import digits_config
from tests.mosquitto import mosquitto


# --- the whole method: what docs/adding-a-method.md shows ----------------------------------------
class BiasAvgOptions(MethodOptions):
    pass


class BiasAvgClient(ClientHalf):
    """Trains locally; shares only its output layer's bias (a toy: the smallest real exchange)."""

    def receive(self, downlink: Message | None) -> None:
        if downlink is not None and "bias" in downlink.tensors:
            self.output_bias().data.copy_(downlink.tensors["bias"])

    def output_bias(self) -> torch.Tensor:
        layers = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
        return layers[-1].bias  # the output layer's

    def fit(self, downlink: Message | None, round_no: int) -> Message:
        self.receive(downlink)
        self.train_locally(round_no, lambda x, y: F.cross_entropy(self.model(x), y))
        return self.reply("head", round_no, {"bias": self.output_bias()})


class BiasAvgServer(ServerHalf):
    def __init__(self, clients, options, **kw) -> None:
        super().__init__(clients, options, **kw)
        self.biases: dict[str, torch.Tensor] = {}
        self.mean: torch.Tensor | None = None

    def accept(self, message: Message) -> Receipt:
        bias = message.tensors.get("bias")
        if set(message.tensors) != {"bias"} or bias.shape != (self.num_classes,):
            return Receipt("rejected", f"expected bias [{self.num_classes}]")
        self.biases[message.sender] = bias
        return Receipt("accepted")

    def downlink(self, round_no: int, client_id: str) -> Message | None:
        return None if self.mean is None else Message("head", round_no, "server", {"bias": self.mean})

    def close_round(self, round_no: int) -> dict:
        self.mean = torch.stack([self.biases[s] for s in sorted(self.biases)]).mean(0)
        return {"averaged": len(self.biases)}


SPEC = MethodSpec("bias-avg", "toy: average the output bias", f"{__name__}:BiasAvgClient", f"{__name__}:BiasAvgServer",
                  f"{__name__}:BiasAvgOptions", uploads=("head",), downloads=("head",))


def register() -> MethodSpec:
    """What a plugin package does on import (here called explicitly, so other tests' walks of the
    registry never see the toy)."""
    return register_method(SPEC)


@pytest.fixture
def bias_avg():
    register()
    yield SPEC
    METHODS.pop(SPEC.name)


def _device_process(config_path, broker: str, device: str) -> subprocess.Popen:
    """``edgefl client`` in a process where the toy method is registered (a device installs the
    plugin that defines it): device processes, as in a real fleet, each with its own RNG."""
    code = ("import sys; import tests.test_adding_a_method as toy; toy.register(); from edgefl.cli import main; "
            f"sys.argv = ['edgefl', 'client', '--broker', {broker!r}, '--config', {str(config_path)!r}, "
            f"'--device-id', {device!r}, '--timeout', '120']; main()")
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_a_method_of_two_halves_and_a_spec_runs_in_simulation_and_as_a_fleet(bias_avg, tmp_path):
    from edgefl.fleet.launcher import serve
    from edgefl.sim import Simulation

    raw = digits_config("bias-avg", rounds=2)
    # MLPs: their output layers have a bias (the FedHe CNNs' do not)
    raw["fleet"]["groups"] = [{"model": "mlp", "count": 2, "options": {"hidden": [32, 16]}},
                              {"model": "mlp", "count": 2, "options": {"hidden": [16]}}]
    raw["train"]["epochs"] = 5
    raw["network"] = {"federation": "bias-avg-test", "round_deadline_s": 60}
    cfg = RunConfig.model_validate(raw)
    sim = Simulation(cfg, show_progress=False).run()
    assert sim["final_accuracy"]["overall"] > 0.2
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    with mosquitto(tmp_path) as broker:
        devices = [_device_process(path, broker, f"client-{i}") for i in range(4)]
        fleet = serve(cfg, broker, None, join_timeout_s=90)
        for d in devices:
            assert d.wait(timeout=60) == 0, d.stderr.read().decode()[-2000:]
    assert [h["outcome"] for h in fleet["history"]] == ["complete", "complete"]
    assert fleet["final_accuracy"] == sim["final_accuracy"]
    assert fleet["history"][-1]["server"] == {"averaged": 4}


# --- the contract --------------------------------------------------------------------------------
def test_every_kind_a_method_sends_is_documented_and_every_documented_kind_is_used():
    used = {kind for spec in METHODS.values() for kind in (*spec.uploads, *spec.downloads)} | set(RUNNER_KINDS)
    assert used == set(MESSAGE_KINDS)


def test_halves_are_abstract():
    with pytest.raises(TypeError, match="abstract"):
        ClientHalf(None, BiasAvgOptions())  # type: ignore[abstract]
    with pytest.raises(TypeError, match="abstract"):
        ServerHalf([], BiasAvgOptions(), seed=0, num_classes=2, input_shape=(1,))  # type: ignore[abstract]


def test_traits_are_read_from_the_spec_not_from_name_lists():
    from edgefl.profile import load_profile
    from edgefl.profile.assign import Budgets, assign, parse_candidates

    one_shot = [s.name for s in METHODS.values() if s.one_shot]
    assert one_shot and all(METHODS[n].generator_clients for n in one_shot)
    # a wristband fits no VGG-9 but a CVAE-small: only methods whose spec takes generators get one
    tiny = load_profile("wristband-mcu")
    budgets = Budgets(headroom=0.8, deadline_s=600, samples=64, epochs=1, batch=16, optimizer="sgd")
    for spec in METHODS.values():
        result = assign(tiny, budgets, spec.name, parse_candidates("vgg9,cvae-small"))
        if spec.generator_clients:
            assert result.chosen is not None and result.chosen.estimate.kind == "generator", spec.name
        else:
            assert result.chosen is None and f"{spec.name} has no generator clients" in result.reason, spec.name
