"""The device-profile schema, the shipped catalog, and bad profile files."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from edgefl.errors import ConfigError
from edgefl.profile import Quantity, catalog, load_profile

EXPECTED = {"pi-zero-2w", "pi4-2gb", "pi4-4gb", "pi5-8gb", "jetson-nano", "jetson-orin-nano",
            "android-midrange", "iphone-15", "wristband-mcu", "esp32-s3"}


def test_catalog_has_every_device_class_and_validates():
    profiles = catalog()
    assert set(profiles) == EXPECTED
    for p in profiles.values():
        quantities = [p.cpu.cores, p.cpu.clock_mhz, p.memory.ram_bytes, p.memory.training_budget_bytes,
                      p.memory.storage_bytes, p.compute.effective_gflops, p.compute.int8_gops]
        for q in quantities:
            assert q.kind in ("spec", "measured", "derived", "unknown")
            assert q.known == bool(q.source)  # every known number carries its source
        assert p.memory.ram_bytes.kind == "spec"
        assert p.memory.training_budget_bytes.value < p.memory.ram_bytes.value


def test_catalog_orders_devices_sensibly():
    c = catalog()
    ram = {k: p.memory.ram_bytes.value for k, p in c.items()}
    assert ram["esp32-s3"] < ram["wristband-mcu"] < ram["pi-zero-2w"] < ram["pi4-2gb"] < ram["pi4-4gb"] < ram["pi5-8gb"]
    assert c["pi5-8gb"].compute.effective_gflops.value > c["pi4-4gb"].compute.effective_gflops.value


def test_load_by_id_and_suggestion():
    assert load_profile("pi4-4gb").name.startswith("Raspberry Pi 4")
    with pytest.raises(ConfigError, match="did you mean 'pi4-4gb'"):
        load_profile("pi4-4g")


def test_quantity_rules():
    with pytest.raises(ValidationError, match="needs its source"):
        Quantity(value=1, kind="spec")
    with pytest.raises(ValidationError, match="has no value"):
        Quantity(value=1, kind="unknown")
    with pytest.raises(ValidationError, match="needs a value"):
        Quantity(kind="measured", source="x")
    with pytest.raises(ValidationError, match="not negative"):
        Quantity(value=-1, kind="measured", source="x")


BASE = '''schema = "edgefl-device-profile/1"
id = "my-board"
name = "My board"
class = "sbc"
'''


@pytest.mark.parametrize(
    "extra, message",
    [
        ('[memory]\nram_bytes = { value = 1024, kind = "spec" }\n', "needs its source"),
        ('[memory]\nram_gb = 4\n', "memory.ram_gb: unknown key (did you mean 'ram_bytes'?)"),
        ('[cpu]\ncores = 4\n', "cpu.cores"),
        ('[accelerator]\ntype = "tpu"\n', "accelerator.type"),
    ],
)
def test_bad_profile_files_are_clear_errors(tmp_path, extra, message):
    path = tmp_path / "p.toml"
    path.write_text(BASE + extra)
    with pytest.raises(ConfigError) as exc:
        load_profile(path)
    assert message in str(exc.value) and "docs/profile-schema.md" in str(exc.value)


def test_wrong_schema_version_and_bad_id(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(BASE.replace("/1", "/9"))
    with pytest.raises(ConfigError, match="is not 'edgefl-device-profile/1'"):
        load_profile(path)
    path.write_text(BASE.replace('"my-board"', '"My Board"'))
    with pytest.raises(ConfigError, match="id"):
        load_profile(path)
    path.write_text("class = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_profile(path)


def test_minimal_profile_defaults_to_unknown(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(BASE)
    p = load_profile(path)
    assert not p.memory.ram_bytes.known and not p.compute.effective_gflops.known
    assert p.to_dict()["class"] == "sbc"
