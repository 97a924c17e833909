"""Configs that used to be accepted and then ran something else than asked, or ended in a traceback,
are refused with the key and what to do: a data folder for a data set that reads none, a float
count (``rounds = 1e9``), an explicit model its device class cannot hold, bytes that are not UTF-8
or a byte order mark, partial-upload budgets smaller than one upload."""

from __future__ import annotations

import pytest

from edgefl.build import build_run
from edgefl.config import MAX_ROUNDS, load_config, validate_config
from edgefl.errors import ConfigError
from tests.conftest import digits_config
from tests.test_cli import ROOT, edgefl

EXAMPLE = ROOT / "examples" / "fedhe_digits_quick.toml"


def refusal(raw: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return caught.value.message


@pytest.mark.parametrize("dataset", ["digits", "breast-cancer"])
def test_a_data_dir_for_a_data_set_that_reads_no_files_is_refused(tmp_path, dataset):
    raw = digits_config("fedavg")
    raw["data"] = {"dataset": dataset, "data_dir": str(tmp_path / "nowhere")}
    message = refusal(raw)
    assert "data_dir" in message and f"{dataset} comes with scikit-learn and reads no files" in message


def test_the_command_line_refuses_a_data_dir_for_digits_before_writing_anything(tmp_path):
    res = edgefl("simulate", str(EXAMPLE), "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run"))
    assert res.returncode == 2 and "reads no files" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("line, key", [
    ("rounds = 1e9", "rounds"),
    ("rounds = 3.0", "rounds"),
    ("seed = 1.5", "seed"),
])
def test_a_float_where_a_count_belongs_is_refused_naming_the_key(tmp_path, line, key):
    text = EXAMPLE.read_text()
    name = line.split(" =")[0]
    path = tmp_path / "run.toml"
    path.write_text("\n".join(line if row.startswith(f"{name} =") else row for row in text.splitlines()) + "\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert f"\n{key}: " in caught.value.message and "whole number" in caught.value.message


@pytest.mark.parametrize("where, value", [
    (("train", "epochs"), 2.0),
    (("train", "batch_size"), 32.0),
    (("train", "max_steps"), True),
    (("eval", "every"), "2"),
    (("data", "samples_per_client"), 100.0),
    (("network", "max_message_bytes"), 1e8),
])
def test_counts_and_sizes_are_integers_in_the_file(where, value):
    raw = digits_config("fedavg")
    raw.setdefault(where[0], {})[where[1]] = value
    message = refusal(raw)
    assert f"{where[0]}.{where[1]}: " in message


def test_a_group_count_written_as_a_float_is_refused():
    raw = digits_config("fedavg")
    raw["fleet"]["groups"][0]["count"] = 2.0
    assert "fleet.groups[0].count: " in refusal(raw)


def test_rounds_have_an_upper_bound():
    assert "rounds: Input should be less than or equal to 1000000" in refusal(digits_config("fedavg", rounds=MAX_ROUNDS + 1))
    assert validate_config(digits_config("fedavg", rounds=MAX_ROUNDS)).rounds == MAX_ROUNDS
    assert validate_config(digits_config("fedavg", rounds=3)).rounds == 3  # an integer stays fine


def test_an_explicit_model_the_device_class_cannot_hold_is_refused():
    raw = digits_config("fedavg", rounds=1)
    raw["fleet"] = {"groups": [{"model": "resnet34", "count": 2, "profile": "esp32-s3"}]}
    with pytest.raises(ConfigError) as caught:
        build_run(validate_config(raw))
    assert "fleet.groups[0]: esp32-s3 cannot hold resnet34: memory: needs" in caught.value.message
    assert 'model = "auto"' in caught.value.hint


def test_a_model_that_only_misses_the_deadline_is_a_straggler_not_a_refusal():
    raw = digits_config("fedavg", rounds=1)
    raw["clock"] = {"deadline_s": 0.001}
    raw["fleet"] = {"groups": [{"model": "mlp", "count": 2, "profile": "pi-zero-2w", "options": {"hidden": [16]}}]}
    parts = build_run(validate_config(raw))
    assert [s.model for s in parts.slots] == ["mlp", "mlp"]


def test_invalid_utf8_is_named_with_its_place(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(EXAMPLE.read_bytes().replace(b'name = "fedhe-digits-quick"', b'name = "fedhe-\xff-quick"'))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    line = next(i for i, row in enumerate(EXAMPLE.read_text().splitlines(), 1) if row.startswith("name ="))
    assert f"is not UTF-8 text: byte 0xff at line {line}, column 15" in caught.value.message


def test_a_byte_order_mark_is_named(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xef\xbb\xbf" + EXAMPLE.read_bytes())
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "byte order mark" in caught.value.message and "without BOM" in caught.value.hint


def test_the_command_line_names_bad_bytes_without_a_traceback(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"rounds = 2\nname = \"\xc3\x28\"\n")
    res = edgefl("simulate", str(path), "--show-config")
    assert res.returncode == 2 and "is not UTF-8 text" in res.stderr and "Traceback" not in res.stderr


def test_a_partial_upload_budget_below_one_upload_is_refused():
    raw = digits_config("fedavg")
    raw["network"] = {"max_message_bytes": 1 << 20, "max_partial_bytes_total": 1 << 19}
    assert "network.max_partial_bytes_total = 524288 is below network.max_message_bytes" in refusal(raw)
    raw["network"] = {"stale_upload_s": 30}
    # an asynchronous run's default: 4 x stale_upload_s (a synchronous one: its round deadline)
    assert validate_config(raw).network.partial_age_limit_s() == 120
