"""Plug-ins (edgefl.plugins, docs/adding-a-method.md section 5): a method and a filter written outside
edgefl run from the command line, in simulation and as a local fleet of device processes, named by
``EDGEFL_PLUGINS`` or by an installed package's entry point; a broken plug-in is said, not fatal;
a device without the plug-in declines its task saying why. The plug-ins load in subprocesses only,
so this process's registries (which other tests walk) never see them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLUGIN = '''
"""A researcher's plug-in: FedAvg of the output bias only, and a filter that counts uploads."""
import torch
from torch.nn import functional as F

from edgefl.algorithms import ClientHalf, MethodOptions
from edgefl.filters import Filter, FilterOptions, register_filter
from edgefl.messages import Message
from edgefl.methods import MethodSpec, register_method
from edgefl.server.methods import Receipt, ServerHalf


class BiasOptions(MethodOptions):
    pass


class BiasClient(ClientHalf):
    def output_bias(self):
        return [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)][-1].bias

    def receive(self, downlink):
        if downlink is not None and "bias" in downlink.tensors:
            self.output_bias().data.copy_(downlink.tensors["bias"])

    def fit(self, downlink, round_no):
        self.receive(downlink)
        self.train_locally(round_no, lambda x, y: F.cross_entropy(self.model(x), y))
        return self.reply("head", round_no, {"bias": self.output_bias()})


class BiasServer(ServerHalf):
    def __init__(self, clients, options, **kw):
        super().__init__(clients, options, **kw)
        self.biases, self.mean = {}, None

    def accept(self, message):
        bias = message.tensors.get("bias")
        if set(message.tensors) != {"bias"} or tuple(bias.shape) != (self.num_classes,):
            return Receipt("rejected", "expected a bias")
        self.biases[message.sender] = bias
        return Receipt("accepted")

    def downlink(self, round_no, client_id):
        return None if self.mean is None else Message("head", round_no, "server", {"bias": self.mean})

    def close_round(self, round_no):
        self.mean = torch.stack([self.biases[s] for s in sorted(self.biases)]).mean(0)
        return {"averaged": len(self.biases)}


class CountOptions(FilterOptions):
    pass


@register_filter
class CountUploads(Filter):
    name = "count-uploads"
    Options = CountOptions
    summary = "counts the uploads the server receives"

    def upload_in(self, message):
        self.seen = getattr(self, "seen", 0) + 1
        return message

    def round_facts(self, round_no):
        return {"uploads_seen": getattr(self, "seen", 0)}


register_method(MethodSpec("bias-plugin", "a plug-in: average the output bias", "biasplug:BiasClient", "biasplug:BiasServer",
                           "biasplug:BiasOptions", uploads=("head",), downloads=("head",)))
'''

CONFIG = '''
name = "plugin-test"
seed = 0
rounds = 2

[method]
name = "bias-plugin"

[data]
dataset = "digits"
partition = "dirichlet"
alpha = 0.5
min_samples = 20

[train]
epochs = 2
batch_size = 32
optimizer = "adam"
lr = 0.003

[network]
federation = "FEDERATION"
round_deadline_s = 60

[eval]
every = 1

[[fleet.groups]]
model = "mlp"
count = 3
options = { hidden = [16] }

[[filters]]
name = "count-uploads"
'''


def _edgefl(args: list[str], env_extra: dict[str, str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EDGEFL_PLUGINS"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "edgefl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def plugin(tmp_path) -> tuple[Path, Path]:
    (tmp_path / "biasplug.py").write_text(PLUGIN)
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.replace("FEDERATION", f"plugin-{os.getpid()}"))
    return tmp_path / "biasplug.py", config


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_plugin_method_and_filter_run_in_simulation_and_as_a_local_fleet_with_the_same_numbers(plugin, tmp_path):
    path, config = plugin
    env = {"EDGEFL_PLUGINS": str(path)}
    sim = _edgefl(["simulate", str(config), "--out", str(tmp_path / "sim")], env, tmp_path)
    assert sim.returncode == 0, sim.stderr[-3000:]
    fleet = _edgefl(["fleet", str(config), "--out", str(tmp_path / "fleet")], env, tmp_path, timeout=400)
    assert fleet.returncode == 0, (fleet.stdout + fleet.stderr)[-3000:]
    sim_records, fleet_records = _records(tmp_path / "sim"), _records(tmp_path / "fleet")
    assert [r["server"] for r in sim_records] == [{"averaged": 3}, {"averaged": 3}]
    assert [r["filters"]["count-uploads"]["uploads_seen"] for r in sim_records] == [3, 6]
    assert [r["accuracy"] for r in fleet_records] == [r["accuracy"] for r in sim_records]
    run = json.loads((tmp_path / "sim" / "run.json").read_text())
    import hashlib

    assert run["plugins"] == [{"env": str(path), "file": str(path.resolve()), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}]
    listed = _edgefl(["filters"], env, tmp_path)
    assert listed.returncode == 0 and "count-uploads" in listed.stdout
    methods = _edgefl(["methods"], {**env, "COLUMNS": "250"}, tmp_path)
    row = next(line for line in methods.stdout.splitlines() if "bias-plugin" in line)
    assert "biasplug" in row and "head / head" in row  # where it comes from, what it sends


def test_an_installed_package_s_entry_point_is_a_plugin(plugin, tmp_path):
    path, _ = plugin
    site = tmp_path / "site"
    (site / "biasplug-0.1.dist-info").mkdir(parents=True)
    (site / "biasplug.py").write_text(path.read_text())
    (site / "biasplug-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: biasplug\nVersion: 0.1\n")
    (site / "biasplug-0.1.dist-info" / "entry_points.txt").write_text("[edgefl.plugins]\nbias = biasplug\n")
    code = textwrap.dedent("""
        import json
        from edgefl.methods import get_method
        from edgefl.plugins import loaded_plugins
        print(get_method("bias-plugin").name, json.dumps(loaded_plugins()))
    """)
    env = {k: v for k, v in os.environ.items() if k != "EDGEFL_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(Path(__file__).parent.parent)])
    out = subprocess.run([sys.executable, "-c", code], cwd=site, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    name, loaded = out.stdout.strip().split(" ", 1)
    assert name == "bias-plugin"
    (record,) = json.loads(loaded)
    assert {"entry_point": "bias", "module": "biasplug", "package": "biasplug", "version": "0.1"}.items() <= record.items()
    assert record["file"] == str((site / "biasplug.py").resolve()) and len(record["sha256"]) == 64


def test_a_broken_plugin_is_said_on_every_command_and_named_where_its_method_is_asked_for(plugin, tmp_path):
    _, config = plugin
    broken = tmp_path / "brokenplug.py"
    broken.write_text("raise RuntimeError('half-written plug-in')\n")
    env = {"EDGEFL_PLUGINS": f"{broken},no_such_module_here"}
    listed = _edgefl(["filters"], env, tmp_path)
    assert listed.returncode == 0 and "quantize" in listed.stdout  # the rest of edgefl works
    assert "plug-in not loaded" in listed.stderr and "half-written plug-in" in listed.stderr and "no_such_module_here" in listed.stderr
    sim = _edgefl(["simulate", str(config), "--out", str(tmp_path / "sim")], env, tmp_path)
    said = " ".join(sim.stderr.split())
    assert sim.returncode == 2 and "unknown method 'bias-plugin'" in said and "a plug-in failed to import" in said, said[-2000:]
    missing = _edgefl(["filters"], {"EDGEFL_PLUGINS": str(tmp_path / "nope.py")}, tmp_path)
    assert "no file" in missing.stderr and missing.returncode == 0
    assert missing.stderr.count("plug-in not loaded") == 1  # said once, not by a logger and again by the command
    script = Path(sys.executable).parent / "edgefl"  # the console script: unlike python -m, it puts no folder on sys.path
    if script.is_file():
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["EDGEFL_PLUGINS"] = "brokenplug"  # a module name, from the plug-in's folder
        by_name = subprocess.run([str(script), "filters"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert "ModuleNotFoundError" in by_name.stderr and "name it as ./brokenplug.py" in by_name.stderr, by_name.stderr


def test_a_device_without_the_plugin_declines_its_task_saying_why():
    """The task names the method, never a module: a device that lacks the plug-in says so to the
    server (a decline with the reason) and stops, instead of leaving the server waiting blind."""
    from edgefl.enrol import Joiner
    from edgefl.errors import PayloadError
    from edgefl.server.enrolment import Enrolment
    from tests.test_device_held import _held_parts

    task = Enrolment(_held_parts([{"model": "lenet5", "count": 2}]), "fed").task("client-0", "run-1").to_info()
    task["method"] = {"name": "bias-plugin", "options": {}}
    sent: list[dict] = []

    class Reply:
        type = "task"
        extra = {"info": {"task": task}}

    class Device(Joiner):
        def __init__(self):
            import time

            self.device, self.federation, self.profile, self.say = "client-0", "fed", None, print
            self.transport = type("Clock", (), {"now": staticmethod(time.monotonic)})()

        def _join(self, stage, **facts):
            sent.append({"stage": stage, **facts})

            class Sent:
                message_id = "m"
            return Sent()

        def _reply(self, asked, wait_s, kinds):
            return Reply()

    with pytest.raises(PayloadError, match="cannot be served by this device: unknown method 'bias-plugin'"):
        Device().ask_task(timeout_s=5)
    assert sent[0]["stage"] == "hello" and sent[-1]["stage"] == "decline" and sent[-1]["run"] == "run-1"
    assert "unknown method 'bias-plugin'" in sent[-1]["reason"] and "plug-in" in sent[-1]["reason"]


def test_a_spec_naming_a_class_that_cannot_be_imported_is_a_config_error_naming_the_field():
    """An outside trial: a typo in a plug-in's spec ("fedprox:FedProxClnt") ended `edgefl simulate`
    with a 61-line traceback and exit 1."""
    from edgefl.errors import ConfigError
    from edgefl.methods import MethodSpec

    spec = MethodSpec("typo", "a plug-in with typos", "edgefl.algorithms.fedavg:FedAvgClnt", "no_such_module_x:Server",
                      "edgefl.algorithms.fedavg")
    with pytest.raises(ConfigError, match="method 'typo': its client_path 'edgefl.algorithms.fedavg:FedAvgClnt' cannot be imported: "
                                          "AttributeError") as caught:
        spec.client_class()
    assert "register_method" in caught.value.hint
    with pytest.raises(ConfigError, match="server_path 'no_such_module_x:Server' cannot be imported: ModuleNotFoundError"):
        spec.server_class()
    with pytest.raises(ConfigError, match="options_path 'edgefl.algorithms.fedavg' cannot be imported: ValueError"):
        spec.options_model  # noqa: B018


def test_a_transport_from_a_plugin_resolves_its_scheme(tmp_path):
    """register_transport in a plug-in: the scheme works wherever a broker URL is read."""
    (tmp_path / "memxplug.py").write_text(textwrap.dedent("""
        from edgefl.transport import memory
        from edgefl.transport.registry import register_transport

        register_transport("memx", memory._server, memory._device, example="memx://NAME", in_process=True)
    """))
    code = "from edgefl.transport.registry import transport_for; print(transport_for('memx://hub').scheme)"
    env = {k: v for k, v in os.environ.items() if k != "EDGEFL_PLUGINS"}
    env["EDGEFL_PLUGINS"] = str(tmp_path / "memxplug.py")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "memx", out.stderr[-2000:]


def test_edgefl_methods_marks_a_plugin_spec_it_cannot_import_as_broken(tmp_path):
    (tmp_path / "typoplug.py").write_text(textwrap.dedent("""
        from edgefl.methods import MethodSpec, register_method

        register_method(MethodSpec("typo-plugin", "a spec with a typo", "typoplug:NoSuchClient", "typoplug:NoSuchServer",
                                   "edgefl.algorithms.fedavg:FedAvgOptions", uploads=("weights",), downloads=("weights",)))
    """))
    listed = _edgefl(["methods"], {"EDGEFL_PLUGINS": str(tmp_path / "typoplug.py"), "COLUMNS": "400"}, tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    row = next(line for line in listed.stdout.splitlines() if "typo-plugin" in line)
    assert "BROKEN" in row and "NoSuchClient" in listed.stdout  # the reason wraps within its cell
    assert "fedavg" in listed.stdout  # the other methods are listed as before
