"""docs/config.md's reference is what the schema says (EDGEFL_WRITE_DOCS=1 rewrites it), and the
command line blames what is wrong: the override, not the file; a method switch drops options."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from edgefl.config import load_config
from edgefl.configdoc import replace_in
from edgefl.errors import ConfigError

CONFIG_MD = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def test_config_md_holds_the_generated_reference():
    text = CONFIG_MD.read_text()
    want = replace_in(text)
    if os.environ.get("EDGEFL_WRITE_DOCS") == "1":
        CONFIG_MD.write_text(want)
    assert text == want, "docs/config.md is out of date: run EDGEFL_WRITE_DOCS=1 pytest tests/test_config_doc.py"
    for section in ("[data]", "[train]", "[[fleet.groups]]", "[eval]", "[clock]", "[network]", "`fedhe`", "`fedmho`"):
        assert f"### `{section}`" in text or f"#### {section}" in text, section
    assert '"auto"' in text  # model = "auto" is documented


def test_an_override_error_names_the_override_not_the_file():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["data.partiton=iid"])
    assert exc.value.message.startswith("--set data.partiton=iid makes the config invalid")
    assert "did you mean 'partition'" in exc.value.message and "alone is valid" in exc.value.hint


def test_switching_the_method_drops_the_files_options_for_the_old_one(caplog):
    with caplog.at_level(logging.WARNING, logger="edgefl.config"):
        cfg = load_config(None, ["method.name=local"], preset="paper")  # FedHe with its options in the file
    assert cfg.method.name == "local" and cfg.method.options() == {}
    assert "dropped" in caplog.text
    with pytest.raises(ConfigError, match="method.alpha: unknown key"):  # an option set on the command line stays
        load_config(None, ["method.name=fedavg", "method.alpha=3"], preset="paper")


def test_the_quick_look_recipe_is_a_valid_command_that_learns_fast():
    """The recipe is parsed the way a shell would and loaded as the CLI would (its accuracy, 0.66
    after three rounds, was measured once: a Fashion-MNIST run is too long for the suite)."""
    import shlex

    section = CONFIG_MD.read_text().split("## A quick look at any example")[1].split("```sh\n")[1].split("```")[0]
    args = shlex.split(section.replace("\\\n", " "))
    assert args[:2] == ["edgefl", "simulate"]
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    cfg = load_config(Path(CONFIG_MD.parent.parent / args[2]), overrides)
    assert cfg.data.dataset == "fashion-mnist" and cfg.rounds <= 3 and cfg.train.max_steps <= 30
    # what makes a short run learn: Adam at its usual rate, on an IID split
    assert (cfg.train.optimizer, cfg.train.lr, cfg.data.partition) == ("adam", 0.001, "iid")
