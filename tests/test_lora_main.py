"""LoRA runs of the main job (the hf family over a tiny Qwen2 directory with weights): 2 gloo ranks (FSDP, TP) equal
one process, the exports load in peft and transformers with functrain's logits, the checkpoints hold the adapters
and a record of the base, a resume after SIGKILL is bit-exact, another base is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _main_job
import _tol
import peft  # (the dev extra: the reference LoRA)
import pytest
import torch
import transformers

from functrain import checkpoint as ckpt
from functrain import tree as tree_lib

pytestmark = pytest.mark.slow  # main-job runs, some under torchrun (the comparisons also on the second torch: numeric)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = ["--config.lora.rank=8", "--config.lora.alpha=16", "--config.lora.targets=q_proj|v_proj"]
SGD = ["--config.optim.name=sgd", "--config.optim.lr=0.05"]  # (trajectories compared within rounding: tests/_tol.py)


def _base(directory, seed: int = 0):
    """A tiny Qwen2 directory with weights (transformers' own init from `seed`)."""
    from functrain.models.hf.tiny import TINY

    config = transformers.AutoConfig.for_model("qwen2", **TINY)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _base(tmp_path_factory.mktemp("qwen2") / "base")


def _run(workdir, base_dir, *extra, nproc=1, check=True):
    """The main job on the hf family over `base_dir` (under torchrun when nproc > 1)."""
    launch = _main_job.command(nproc)
    args = [
        "--config=configs/hf.py",
        f"--config.model.path={base_dir}",
        f"--workdir={workdir}",
        "--config.compile=False",
        "--config.batch_size=8",
        "--config.model.block_size=64",
        "--config.log_every=1",
        "--config.eval_every=1000",
        "--config.eval_batches=1",
        "--config.sample.max_new_tokens=8",
        "--config.dist_timeout_s=600",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run([*launch, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if check and out.returncode != 0:
        pytest.fail(
            f"exit {out.returncode}\n--- stdout ---\n{out.stdout[-3000:]}\n--- stderr ---\n{out.stderr[-8000:]}",
            pytrace=False,
        )
    return out


def _rows(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _params(step_dir):
    """The params a checkpoint holds (plain tensors, by name)."""
    return ckpt.restore(str(step_dir), {"params": ckpt.metadata_tree(str(step_dir))["params"]}).result()["params"]


def _bytes(directory):
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@pytest.mark.numeric
def test_two_ranks_fsdp_and_tp_equal_one_process(tmp_path, base):
    """10 SGD steps of q/v adapters: 2 ranks sharding the base (FSDP, a gather per decoder layer) and 2 ranks
    splitting its heads (TP, the adapters following their layers' plan) log the losses and end with the adapters
    of one process, within the rounding of their reductions."""
    steps = ["--config.steps=10", "--config.checkpoint.every=10", *SGD, *LORA]
    _run(tmp_path / "one", base, *steps)
    fsdp = _run(tmp_path / "fsdp", base, *steps, "--config.mesh.dp_shard=2", nproc=2)
    tp = _run(tmp_path / "tp", base, *steps, "--config.mesh.dp_shard=1", "--config.mesh.tp=2", nproc=2)
    assert "'dp_shard': 2" in fsdp.stdout and "'tp': 2" in tp.stdout
    rtol = _tol.rtol(8 * 64 * 384)
    one = {r["step"]: r for r in _rows(tmp_path / "one") if "loss" in r}
    want = _params(tmp_path / "one" / "checkpoints" / "10")
    assert sorted(want) == sorted(n for n in want if ".lora_" in n) and len(want) == 8  # adapters only
    for name in ("fsdp", "tp"):
        got = {r["step"]: r for r in _rows(tmp_path / name) if "loss" in r}
        assert sorted(got) == sorted(one) == list(range(1, 11)), name
        for i, step in enumerate(sorted(one)):
            drift = 1 + i * 2 * _tol.sgd_gain(0.05, 0.9)
            for key in ("loss", "grad_norm"):
                assert abs(got[step][key] - one[step][key]) <= rtol * drift * one[step][key], (name, step, key)
        atol = _tol.trajectory_atol(steps=10, gain=_tol.sgd_gain(0.05, 0.9), grad_scale=1.0, n=8 * 64 * 384)
        _tol.assert_close(_params(tmp_path / name / "checkpoints" / "10"), want, atol, absolute=True, msg=name)


def test_exports_checkpoints_and_the_base_record(tmp_path, base):
    """The run's PEFT directory loads in peft over the base and its merged directory in transformers, both with the
    logits functrain computes from the checkpoint; --export_hf on the checkpoint writes the same files; the
    checkpoint holds the adapters and their optimizer state (a fraction of a full fine-tune's bytes) and the
    base's digest, which is the digest of the directory's weights (the base never written); a resume over
    another base stops in one line."""
    import functrain
    from functrain.nn import lora
    from functrain.trainer import frozen as frozen_lib

    work = tmp_path / "lora"
    out = _run(work, base, "--config.steps=6", *LORA)
    assert "trains 7,168 of 467,072 params (1.53%); the rest frozen" in out.stdout
    summary = json.loads((work / "summary.json").read_text())
    assert (summary["params_trained"], summary["params_total"]) == (7168, 467072)
    step = work / "checkpoints" / "6"
    adapters = _params(step)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    base_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = lora.wrap(model, lora.LoraSpec(rank=8, alpha=16, targets="q_proj|v_proj"))
    with torch.no_grad():
        ours = functrain.apply(wrapped, {**base_params, **adapters}, input_ids=ids, train=False).logits
        plain = model(input_ids=ids).logits
        assert (ours - plain).abs().max() > 1e-4  # the adapters trained
        peft_model = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base), str(work / "hf-peft")
        ).eval()
        merged = transformers.AutoModelForCausalLM.from_pretrained(work / "hf").eval()
        tol = _tol.rtol(128 * 8)
        _tol.assert_close(peft_model(input_ids=ids).logits, ours, tol, msg="peft")
        _tol.assert_close(merged(input_ids=ids).logits, ours, tol, msg="merged")

    record = ckpt.read_custom_metadata(str(step))["functrain"][frozen_lib.KEY]
    assert record["digest"] == ckpt.digest(base_params) and record["params"] == 467072 - 7168
    export = tmp_path / "export"
    _run(work, base, *LORA, f"--export_hf={export}")
    assert (work / "hf" / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()
    assert (work / "hf-peft" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "export-peft" / "adapter_model.safetensors"
    ).read_bytes()

    full = tmp_path / "full"
    _run(full, base, "--config.steps=2")
    lora_bytes, full_bytes = _bytes(step), _bytes(full / "checkpoints" / "2")
    assert lora_bytes < full_bytes / 5, (lora_bytes, full_bytes)  # adapters + moments vs every param + moments

    other = _base(tmp_path / "other", seed=1)  # the same shapes, other weights
    refused = _run(work, other, "--config.steps=8", *LORA, check=False)
    assert refused.returncode != 0
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(f"functrain: error: {step} trained its adapters over another base (model {base}")
    ), refused.stderr[-2000:]


def test_a_lora_run_killed_with_sigkill_resumes_bit_exactly(tmp_path, base):
    """Adapter dropout drawn from the step's key, AdamW: a run killed after its step-4 checkpoint and started
    again logs the uninterrupted run's losses and ends with its adapters and moments, bit for bit."""
    args = ["--config.steps=8", "--config.checkpoint.every=4", *LORA, "--config.lora.dropout=0.1"]
    _run(tmp_path / "straight", base, *args)
    _run(tmp_path / "killed", base, *args, "--config.stop_at=4")  # (a checkpoint, then the process ends)
    cmd = [
        sys.executable,
        "-m",
        "functrain.main",
        "--config=configs/hf.py",
        f"--config.model.path={base}",
        f"--workdir={tmp_path / 'killed'}",
        "--config.compile=False",
        "--config.batch_size=8",
        "--config.model.block_size=64",
        "--config.log_every=1",
        "--config.eval_every=1000",
        *args,
    ]
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in p.stdout:  # resumed from step 4: killed at step 6, before the next save (step 8)
            if line.startswith("step 6/"):
                break
    finally:
        p.kill()  # SIGKILL: no handler runs
        p.wait()
    resumed = _run(tmp_path / "killed", base, *args)
    assert "restored checkpoint step 4" in resumed.stdout
    want = {r["step"]: r["loss"] for r in _rows(tmp_path / "straight") if "loss" in r}
    got = {r["step"]: r["loss"] for r in _rows(tmp_path / "killed") if "loss" in r and r["step"] > 4}
    assert got == {s: want[s] for s in range(5, 9)}
    a = dict(tree_lib.named_leaves(ckpt.restore(str(tmp_path / "straight" / "checkpoints" / "8")).result()))
    b = dict(tree_lib.named_leaves(ckpt.restore(str(tmp_path / "killed" / "checkpoints" / "8")).result()))
    assert a.keys() == b.keys() and not any(k.startswith("frozen.") and b[k].numel() for k in b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.numeric
def test_a_pipeline_trains_adapters_as_one_process_and_moves_between_meshes(tmp_path):
    """GPT adapters over its fresh base on 2 pipeline stages (4 microbatches, 1F1B; each rank holds its stages'
    base and adapters): the losses of one process accumulating 4 microbatches; the pipeline's step-5 checkpoint
    (its base digest pooled over the stages) resumes on one process and ends where one process does."""
    gpt = [
        "--config=configs/gpt.py:tiny",
        "--config.compile=False",
        "--config.log_every=1",
        "--config.eval_every=1000",
        "--config.eval.tasks=",
        "--config.sample.max_new_tokens=8",
        "--config.lora.rank=4",
        "--config.optim.name=sgd",
        "--config.optim.lr=0.05",
        "--config.steps=10",
        "--config.checkpoint.every=5",
        "--config.dist_timeout_s=600",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)

    def run(workdir, *extra, nproc=1):
        launch = (
            [sys.executable, "-m", "functrain.main"]
            if nproc == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                "-m",
                "functrain.main",
            ]
        )
        out = subprocess.run(
            [*launch, f"--workdir={workdir}", *gpt, *extra],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, out.stderr[-6000:]
        return out

    run(tmp_path / "one", "--config.accum_steps=4")
    pp = run(
        tmp_path / "pp",
        "--config.mesh.pp=2",
        "--config.mesh.dp_shard=1",
        "--config.pp.microbatches=4",
        "--config.stop_at=5",
        nproc=2,
    )
    assert "x pp=2" in pp.stdout and "the rest frozen" in pp.stdout
    resumed = run(tmp_path / "pp", "--config.accum_steps=4")
    assert "restored checkpoint step 5" in resumed.stdout
    one = {r["step"]: r for r in _rows(tmp_path / "one") if "loss" in r}
    two = {r["step"]: r for r in _rows(tmp_path / "pp") if "loss" in r}
    assert sorted(two) == sorted(one) == list(range(1, 11))
    rtol = _tol.rtol(16 * 64 * 4 * 64)
    for i, step in enumerate(sorted(one)):
        drift = 1 + i * 2 * _tol.sgd_gain(0.05, 0.9)
        for key in ("loss", "grad_norm"):
            assert abs(two[step][key] - one[step][key]) <= rtol * drift * one[step][key], (step, key)


def test_exports_are_checked_before_step_1_and_adapters_start_from_a_peft_directory(tmp_path, base):
    """A file where the LoRA run's PEFT directory goes stops the run before any step (the file kept); a run with
    lora.init_from starts from that directory's adapters exactly (lr 0: the checkpoint holds them unchanged)."""
    from functrain.models import lm_lora
    from functrain.nn import lora

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "hf-peft").write_text("mine")
    out = _run(blocked, base, "--config.steps=2", *LORA, check=False)
    line = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and line.startswith(f"functrain: error: {blocked / 'hf-peft'} is a file"), line
    assert "step 1/" not in out.stdout and (blocked / "hf-peft").read_text() == "mine"

    first = tmp_path / "first"
    _run(first, base, "--config.steps=3", *LORA)
    peft_dir = first / "hf-peft"
    again = tmp_path / "again"
    _run(
        again, base, "--config.steps=1", *SGD[:1], "--config.optim.lr=0.0", f"--config.lora.init_from={peft_dir}", *LORA
    )
    spec = lora.LoraSpec(rank=8, alpha=16, targets="q_proj|v_proj")
    model = lora.wrap(transformers.AutoModelForCausalLM.from_pretrained(base), spec)
    want = lm_lora.read_peft(str(peft_dir), model, spec, str, str(base))
    got = _params(again / "checkpoints" / "1")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert any(want[n].abs().max() > 0 for n in want if "lora_B" in n)  # trained adapters, not fresh ones
