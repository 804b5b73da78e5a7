"""Interop with the real orbax-checkpoint package, both ways; orbax runs in a separate process."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import pytest
import torch
from _ckpt_util import assert_bits_equal, full_state, leaves_by_name, load_dump, orbax_missing, run_orbax

from functrain import checkpoint as ckpt

pytestmark = [
    pytest.mark.skipif(orbax_missing() is not None, reason=str(orbax_missing())),
    pytest.mark.slow,
]  # slow: stock orbax (jax) in its own process


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    """We save a mixed state; one orbax process restores it and writes its own checkpoints."""
    wd = str(tmp_path_factory.mktemp("ckpt_orbax"))
    with ckpt.Manager(os.path.join(wd, "ours")) as mgr:
        mgr.save(5, full_state(), custom_metadata=_CUSTOM)
    read = ["--read", os.path.join(wd, "ours"), "5", os.path.join(wd, "read")]
    run_orbax(read + ["--write", os.path.join(wd, "theirs"), os.path.join(wd, "wrote")])
    return wd


_CUSTOM = {"functrain": {"data": {"sources": {"data": {"files": [["a.jsonl", 12, "ab" * 32]], "tokenizer": "bytes"}}}}}


def test_orbax_reads_our_custom_metadata(interop):
    with open(os.path.join(interop, "read.custom.json")) as f:
        assert json.load(f) == _CUSTOM
    assert ckpt.Manager(os.path.join(interop, "ours")).custom_metadata(5) == _CUSTOM


def test_orbax_restores_our_checkpoint_bit_exact(interop):
    got = load_dump(os.path.join(interop, "read"))
    want = leaves_by_name(full_state())
    assert sorted(got) == sorted(want)
    for name in want:
        assert_bits_equal(got[name], want[name], name)  # bf16, int64 (x64 off), nan/-0/inf


def _orbax_template(wrote):
    spec = {k: ckpt.ArraySpec(v.shape, v.dtype) for k, v in wrote.items()}
    return {
        "params": {
            "dense": {"kernel": spec["params.dense.kernel"], "bias": spec["params.dense.bias"]},
            "embed.weight": spec["params.embed.weight"],
        },
        "opt": ({"mu": spec["opt.0.mu"]}, [spec["opt.1.0"], spec["opt.1.1"]]),
        "step": spec["step"],
        "key": spec["key"],
    }


def test_we_restore_orbax_checkpoint_by_tree_path(interop):
    wrote = load_dump(os.path.join(interop, "wrote"))
    mgr = ckpt.Manager(os.path.join(interop, "theirs"))
    assert mgr.all_steps() == [3]
    out = mgr.restore(3, _orbax_template(wrote)).result()
    got = leaves_by_name(out)
    assert sorted(got) == sorted(wrote)
    for name in wrote:
        assert_bits_equal(got[name], wrote[name], name)

    class Top(NamedTuple):  # NamedTuple fields match orbax's dict keys by name; subsets are fine
        params: dict
        step: torch.Tensor

    step = torch.empty((), dtype=torch.int64, device="meta")
    sub = mgr.restore(3, Top(_orbax_template(wrote)["params"], step)).result()
    assert isinstance(sub, Top) and sub.step.item() == 5
    assert_bits_equal(sub.params["embed.weight"], wrote["params.embed.weight"])
    mgr.close()


@pytest.mark.parametrize("root", ["theirs", "theirs_zarr3"])
def test_we_restore_orbax_checkpoint_without_template(interop, root):
    wrote = load_dump(os.path.join(interop, "wrote"))
    out = ckpt.restore(os.path.join(interop, root, "3")).result()
    assert isinstance(out["opt"], list) and isinstance(out["opt"][1], list)  # sequences come back as lists
    got = leaves_by_name(out)
    assert sorted(got) == sorted(wrote)
    for name in wrote:
        assert_bits_equal(got[name], wrote[name], name)


def test_metadata_of_orbax_checkpoint(interop):
    meta = ckpt.read_metadata(os.path.join(interop, "theirs", "3"))
    assert meta["params.embed.weight"].shape == (8, 4)
    assert meta["params.embed.weight"].dtype == torch.bfloat16
    assert meta["params.embed.weight"].chunks == (4, 4)  # written by 2 jax devices
    assert meta["step"].dtype == torch.int64 and meta["step"].shape == ()


def _main_job_checkpoint(workdir, nproc: int) -> str:
    """Runs the tiny main job for 10 steps (checkpoints at 5 and 10); returns checkpoint 10's path."""
    import subprocess

    import _main_job
    from _ckpt_util import REPO

    launch = _main_job.command(nproc)
    args = [
        "--config=configs/gpt.py:tiny",
        "--config.steps=10",
        "--config.checkpoint.every=5",
        "--config.compile=False",
        "--config.sample.max_new_tokens=4",
        "--config.eval.tasks=",
        f"--workdir={workdir}",
    ]
    if nproc > 1:
        args.append(f"--config.mesh.dp_shard={nproc}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run([*launch, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return os.path.join(workdir, "checkpoints", "10")


def test_orbax_restores_empty_subtrees_without_template(tmp_path):
    """Empty containers and Nones (a stateless transform's `()`, an empty dict) survive a template-free
    restore by stock orbax (recorded in _METADATA as orbax does)."""
    tree = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "clip": (),
        "opt": [torch.ones(2), ()],
        "extra": {},
        "nothing": None,
    }
    ckpt.save(str(tmp_path / "ck" / "1"), tree)
    run_orbax(["--standard", str(tmp_path / "ck" / "1" / "default"), str(tmp_path / "theirs")])
    with open(str(tmp_path / "theirs") + ".empty.json") as f:
        extra = json.load(f)
    assert extra["empty"] == {"clip": "tuple", "opt.1": "tuple", "extra": "dict", "nothing": "None"}, extra["empty"]
    assert sorted(load_dump(str(tmp_path / "theirs"))) == ["opt.0", "w"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_orbax_restores_main_job_checkpoint_without_template(tmp_path, nproc):
    """`StandardCheckpointer().restore(<step>/default)` with no template gets the whole train state,
    empty optimizer subtrees included, and restores it column-sharded onto 2 jax devices."""
    from functrain import state as state_lib
    from functrain import tree as tree_lib

    path = _main_job_checkpoint(tmp_path / "run", nproc)
    run_orbax(["--standard", os.path.join(path, "default"), str(tmp_path / "theirs")])
    theirs = load_dump(str(tmp_path / "theirs"))
    with open(str(tmp_path / "theirs") + ".empty.json") as f:
        extra = json.load(f)

    ours = ckpt.restore(path).result()  # our own reader, no template either
    want = leaves_by_name(ours)
    assert sorted(theirs) == sorted(want) and len(want) > 20
    for name in want:
        assert_bits_equal(theirs[name], want[name], name)
    # The tree really is the train state: every field with leaves (the GPT has no buffers, so no
    # model state, and trains every param, so no frozen ones), the hyper-parameters as float64 0-d leaves.
    assert {n.split(".")[0] for n in want} == set(state_lib.TrainState._fields) - {"model_state", "frozen"}
    assert extra["empty"] == {"model_state": "dict", "frozen": "dict"}, extra["empty"]  # empty subtrees stay
    assert float(ours["opt_state"][0]["hyper"]["clip"]) == 1.0 and "opt_state.1.2.hyper.lr" in theirs
    assert extra["column_sharded"] >= 8  # every block matrix restored with another sharding
    assert int(tree_lib.leaves(ours["step"])[0]) == 10
