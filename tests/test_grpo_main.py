"""GRPO through the main job (`configs/grpo.py`: the hf family over a fresh tiny Qwen2, the additions task, bytes):
its rollout metrics, a resume bit-exact with its rollouts (one step per rollout: sampled again from the restored
params; two: read back from the workdir), the reward rising over the config's own run, one line for bad input."""

from __future__ import annotations

import json
import os
import subprocess

import _main_job
import _tol
import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow]  # main-job runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = [
    "--config.steps=4",
    "--config.batch_size=4",
    "--config.grpo.num_generations=4",
    "--config.log_every=1",
    "--config.checkpoint.every=100",
    "--config.compile=False",
]
ROLLOUT = (
    "reward",
    "reward_std",
    "rewards/correct/mean",
    "rewards/formatted/mean",
    "advantage/std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "rollout_tokens_per_s",
    "entropy",
    "clip_ratio/region_mean",
)


def _run(workdir, *extra, check=True, nproc=1):
    """The main job on `configs/grpo.py` (under torchrun when nproc > 1); (its metrics rows, the process)."""
    launch = _main_job.command(nproc)
    cmd = [*launch, "--config=configs/grpo.py", f"--workdir={workdir}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    path = workdir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "loss" in r], out


def _weights(workdir):
    """The exported model's tensors."""
    return load_file(workdir / "hf" / "model.safetensors")


@pytest.mark.parametrize(
    "iterations, extra",
    [(1, []), (2, ["--config.lora.rank=4", "--config.grpo.beta=0.04", "--config.grpo.temperature=0.7"])],
    ids=["one", "two_lora_kl"],
)
def test_a_run_killed_between_steps_resumes_bit_exactly_with_its_rollouts(tmp_path, iterations, extra):
    """Stopped after step 3 (with 2 steps per rollout: inside the rollout of step 3), restarted: the same rollouts,
    metrics and final weights as the run that went through; the rollout metrics logged at every step. Under LoRA
    the completions are sampled from the base with the adapters, and the KL is to the base alone (0 at step 1)."""
    common = [*SHORT, f"--config.grpo.num_iterations={iterations}", "--config.grpo.max_new_tokens=6", *extra]
    whole, _ = _run(tmp_path / "whole", *common)
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    for key in ROLLOUT:
        assert all(key in r for r in whole[::iterations]), (key, whole[0])
    if extra:
        assert whole[0]["kl"] == 0 and whole[-1]["kl"] > 0, [r["kl"] for r in whole]
    part, _ = _run(tmp_path / "part", *common, "--config.stop_at=3")
    assert [r["step"] for r in part] == [1, 2, 3]
    resumed, out = _run(tmp_path / "part", *common)
    assert "restored checkpoint step 3" in out.stdout + out.stderr
    if iterations == 2:
        assert (tmp_path / "part" / "rollouts").is_dir()
    rows = {r["step"]: r for r in part + resumed}
    for r in whole:
        for key in ("loss", "grad_norm", *[k for k in ROLLOUT if k in r and "per_s" not in k]):
            assert rows[r["step"]][key] == r[key], (r["step"], key)
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "part")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.numeric
@pytest.mark.parametrize(
    "mesh", [["--config.mesh.dp_shard=2"], ["--config.mesh.dp_replicate=2", "--config.mesh.dp_shard=1"]],
    ids=["fsdp", "replicated"],
)  # fmt: skip
def test_two_ranks_sample_and_train_as_one_process(tmp_path, mesh):
    """2 gloo ranks equal one process: the same rollouts, losses and weights, with 2 steps per rollout at temperature
    0.7. Under FSDP each rank samples the whole batch through the sharded forward (and recomputes its old log-probs
    so) and keeps its half of the prompts; replicated, each rank holds the whole model and samples its half alone,
    compiled-ready; the rewards are gathered for the advantages. The old log-probs recomputed at the rollout are the
    policy's own at its first step: its loss is that of a run taking one step per rollout."""
    sgd = ["--config.steps=3", "--config.optim.name=sgd", "--config.optim.lr=0.1", "--config.optim.momentum=0"]
    sgd += ["--config.grpo.temperature=0.7"]
    one, _ = _run(tmp_path / "one", *SHORT, *sgd, "--config.grpo.num_iterations=2")
    two, out = _run(tmp_path / "two", *SHORT, *sgd, "--config.grpo.num_iterations=2", *mesh, nproc=2)
    rows = 4 * 4 // 2 if "--config.mesh.dp_shard=1" in mesh else 4 * 4  # (4 prompts x 4 completions a step)
    assert f"sampled in rows of {rows}," in out.stdout + out.stderr
    tol = _tol.rtol(4 * 4 * 16 * 128 * 3)
    for a, b in zip(one, two, strict=True):
        for key in [k for k in ROLLOUT if "per_s" not in k and k in a]:  # the same completions, scored alike
            assert b[key] == pytest.approx(a[key], rel=tol, abs=tol), (a["step"], key)
        assert b["loss"] == pytest.approx(a["loss"], rel=tol, abs=tol)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert all(torch.allclose(a[k], b[k], rtol=tol, atol=tol) for k in a)
    each, _ = _run(tmp_path / "each", *SHORT, *sgd, "--config.steps=1")  # old log-probs: the policy's, detached
    assert one[0]["loss"] == pytest.approx(each[0]["loss"], rel=tol, abs=tol)


def test_the_configs_reward_rises_by_the_margin_its_docs_state(tmp_path):
    """The config's own run (eager: the same steps, ~3x less time to the first): the mean reward of its last 5
    steps over that of its first 5."""
    rows, out = _run(tmp_path / "run", "--config.log_every=1", "--config.compile=False")
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.3, (first, last)
    assert "17+25=" in out.stdout


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--config.grpo.max_new_tokens=14"], "prompt 0 has 6 tokens: with grpo.max_new_tokens=14 it exceeds"),
        (["--config.grpo.rewards=('nowhere_mod:fn',)"], "reward 'nowhere_mod:fn': module 'nowhere_mod' does not"),
        (["--config.grpo.rewards=('functrain.data.additions:nothing',)"], "reward 'functrain.data.additions:nothing'"),
        (["--config.grpo.reward_weights=(1.0,)"], "grpo.reward_weights has 1 weights for 2 reward functions"),
        (["--config.grpo.num_generations=1"], "1 completion per prompt: a group's reward std needs 2"),
    ],
)
def test_bad_input_stops_in_one_line(tmp_path, extra, expected):
    _, out = _run(tmp_path / "bad", *SHORT, *extra, check=False)
    lines = [line for line in out.stderr.splitlines() if line.startswith("functrain: error:")]
    assert out.returncode != 0 and len(lines) == 1 and expected in lines[0], out.stderr[-2000:]
