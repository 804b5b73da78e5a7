"""Config validation: every declared check rejects an out-of-range value with one line naming the
key, the value, the valid range and the flag; the default configs pass all of them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from functrain import config_checks
from functrain.models.gpt import checks as gpt_checks
from functrain.trainer import optimizer_checks, validate

_spec = importlib.util.spec_from_file_location(
    "gpt_config", Path(__file__).resolve().parent.parent / "configs" / "gpt.py"
)
gpt_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt_config)

ALL = [*validate.LOOP_CHECKS, *optimizer_checks.CHECKS, *gpt_checks.CHECKS]
SINGLE = [c for c in ALL if isinstance(c[0], str)]  # one key each; relations (several keys) below


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
    if valid.startswith("a number in (0, 1)"):
        return 1.0
    if valid.startswith("a non-empty") or valid.startswith("the name of"):
        return ""
    if valid.startswith("{source name: positive weight}"):
        return {"web": -1.0}
    if valid.startswith("one of "):
        return "bogus"
    if valid == "True or False":
        return "yes"
    return "sometimes"  # the remat policy


@pytest.mark.parametrize("variant", ["tiny", None, "gpt2"])
def test_default_configs_pass_every_check(variant):
    config_checks.check_all(gpt_config.get_config(variant), ALL)


@pytest.mark.parametrize("key, check", SINGLE, ids=[k for k, _ in SINGLE])
def test_every_check_rejects_out_of_range_values_in_one_line(key, check):
    config = gpt_config.get_config("tiny").to_dict()  # plain dicts: ConfigDict would refuse a wrong type itself
    _, valid = check
    bad = _bad_value(valid, config_checks.get(config, key))
    parent, _, leaf = key.rpartition(".")
    node = config_checks.get(config, parent) if parent else config
    node[leaf] = bad
    with pytest.raises(config_checks.ConfigError) as err:
        config_checks.check_all(config, ALL)
    msg = str(err.value)
    assert msg == f"{key}={bad!r} is out of range: {valid} (--config.{key})"
    assert "\n" not in msg


def test_each_key_is_checked_once():
    keys = [k for k, _ in ALL]
    assert len(keys) == len(set(keys))


def _llama_config():
    spec = importlib.util.spec_from_file_location(
        "llama_config", Path(__file__).resolve().parent.parent / "configs" / "llama.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny").to_dict()


def _first_error(config, checks):
    """The message of the first check `config` fails, or None."""
    try:
        config_checks.check_all(config, checks)
    except config_checks.ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            {"n_embd": 64, "n_head": 3},
            "model.n_embd=64, model.n_head=3: n_head must divide n_embd (each head gets "
            "n_embd / n_head channels); change either (--config.model.n_embd / --config.model.n_head)",
        ),
        ({"n_embd": 64, "n_head": 4}, None),
        (
            {"n_head": 0},
            "model.n_head=0 is out of range: an integer >= 1 (--config.model.n_head)",
        ),  # before the relation
    ],
)
def test_gpt_relations_name_every_key_in_one_line(changes, expected):
    config = gpt_config.get_config("tiny").to_dict()
    config["model"].update(changes)
    assert _first_error(config, gpt_checks.CHECKS) == expected


@pytest.mark.parametrize(
    "changes, init_from, expected",
    [
        (
            {"n_head": 4, "n_kv_head": 3},
            "",
            "init_from='', model.n_head=4, model.n_kv_head=3: n_kv_head must divide n_head",
        ),
        ({"n_head": 4, "n_kv_head": 3}, "hf:/models/x", None),  # the shape comes from the HF config.json
        (
            {"n_embd": 120, "n_head": 8, "n_kv_head": 8, "head_dim": 0},
            "",
            "init_from='', model.n_embd=120, model.n_head=8, model.head_dim=0: "
            "each head needs an even number of channels",
        ),
        (
            {"n_embd": 100, "n_head": 8, "n_kv_head": 8, "head_dim": 0},
            "",
            "init_from='', model.n_embd=100, model.n_head=8",
        ),
        ({"n_embd": 100, "n_head": 8, "n_kv_head": 8, "head_dim": 6}, "", None),
        ({"n_embd": 128, "n_head": 4, "n_kv_head": 0}, "", "model.n_kv_head=0 is out of range"),
    ],
)
def test_llama_relations_hold_unless_the_shape_comes_from_hugging_face(changes, init_from, expected):
    from functrain.models.llama import checks as llama_checks

    config = _llama_config()
    config["model"].update(changes)
    config["init_from"] = init_from
    error = _first_error(config, llama_checks.CHECKS)
    if expected is None:
        assert error is None
    else:
        assert error is not None and error.startswith(expected), error
        assert "\n" not in error


@pytest.mark.parametrize(
    "batch, accum, dp, ok",
    [(16, 2, 4, True), (16, 4, 2, True), (15, 1, 2, False), (16, 3, 1, False), (8, 1, 16, False)],
)
def test_check_batch_splits_into_ranks_and_micro_batches(batch, accum, dp, ok):
    if ok:
        config_checks.check_batch(batch, accum, dp)
    else:
        with pytest.raises(
            config_checks.ConfigError,
            match=rf"^batch_size={batch} must divide by data-parallel "
            rf"ranks \({dp}\) x accum_steps \({accum}\);",
        ):
            config_checks.check_batch(batch, accum, dp)


def test_a_block_size_whose_attention_cannot_fit_is_refused_before_any_work():
    """block_size=100000 on the CPU: one line naming the scores' size, from the torch-free checks."""
    from functrain.trainer import main

    c = gpt_config.get_config()
    c.model.block_size = 100_000
    c.device = "cpu"
    with pytest.raises(
        config_checks.ConfigError,
        match=r"model.block_size=100000: one attention layer's scores alone take "
        r"4768.4 GiB \(32 rows x 4 heads x 100000 x 100000 floats\)",
    ):
        main.check_config(c)
    config_checks.check_attention_fits(1024, 12, 8, memory=2**30)  # 384 MiB of scores in 1 GiB: fine
    with pytest.raises(config_checks.ConfigError, match="raise --config.accum_steps"):
        config_checks.check_attention_fits(1024, 12, 8, memory=2**28)
    c.model.block_size = 256
    main.check_config(c)  # the default's block size passes


def test_config_dump_prints_the_resolved_checked_config_and_runs_nothing(tmp_path):
    """`--config_dump`: the file, its variant and the flags resolved, every key the run reads, as JSON; a bad
    value is the run's one line; no workdir is made."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]

    def dump(*flags):
        cmd = [sys.executable, "-m", "functrain.main", "--config=configs/gpt.py:tiny", "--config_dump", *flags]
        return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)

    out = dump(f"--workdir={tmp_path / 'run'}", "--config.steps=7", "--config.optim.lr=0.002")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    want = gpt_config.get_config("tiny")
    assert got["steps"] == 7 and got["optim"]["lr"] == 0.002
    assert set(got) == set(want.keys()) and set(got["data"]) == set(want.data.keys())
    assert got["model"] == want.model.to_dict()
    assert not (tmp_path / "run").exists()
    bad = dump("--config.steps=-3")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == (
        "functrain: error: steps=-3 is out of range: an integer >= 1 (--config.steps)"
    )
