"""Config validation: every declared check rejects an out-of-range value with one line naming the
key, the value, the valid range and the flag; the default configs pass all of them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from functrain import optim, validate
from functrain.models.gpt import task as gpt_task

_spec = importlib.util.spec_from_file_location("gpt_config", Path(__file__).resolve().parent.parent / "configs" / "gpt.py")
gpt_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt_config)

ALL = [*validate.LOOP_CHECKS, *optim.config.CHECKS, *gpt_task.CHECKS]


def _bad_value(valid: str, value):
    """A value outside the range a check's words describe."""
    if valid.startswith("an integer >= "):
        return int(valid.split(">= ")[1]) - 1
    if valid.startswith("a number >= "):
        return float(valid.split(">= ")[1]) - 1.0
    if valid.startswith("a number > "):
        return float(valid.split("> ")[1])
    if valid.startswith("a number in ["):
        return float(valid.split(", ")[1].rstrip(")"))
    if valid.startswith("one of "):
        return "bogus"
    if valid == "True or False":
        return "yes"
    return "sometimes"  # the remat policy


@pytest.mark.parametrize("variant", ["tiny", None, "gpt2"])
def test_default_configs_pass_every_check(variant):
    validate.check_all(gpt_config.get_config(variant), ALL)


@pytest.mark.parametrize("key, check", ALL, ids=[k for k, _ in ALL])
def test_every_check_rejects_out_of_range_values_in_one_line(key, check):
    config = gpt_config.get_config("tiny").to_dict()  # plain dicts: ConfigDict would refuse a wrong type itself
    _, valid = check
    bad = _bad_value(valid, validate.get(config, key))
    parent, _, leaf = key.rpartition(".")
    node = validate.get(config, parent) if parent else config
    node[leaf] = bad
    with pytest.raises(validate.ConfigError) as err:
        validate.check_all(config, ALL)
    msg = str(err.value)
    assert msg == f"{key}={bad!r} is out of range: {valid} (--config.{key})"
    assert "\n" not in msg


def test_each_key_is_checked_once():
    keys = [k for k, _ in ALL]
    assert len(keys) == len(set(keys))
