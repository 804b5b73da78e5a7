"""Preference tuning through the main job (`configs/dpo.py`: the hf family over a tiny Qwen2 directory with a
tokenizer as Qwen2.5 ships it, text pairs from a jsonl): equal to TRL's DPOTrainer step by step, its training
metrics, the held-out rewards and the final weights (a full fine-tune, the reference a frozen copy; LoRA, TRL with
a PEFT model, the reference the adapters off), 2 gloo ranks (FSDP) equal to one process, a run that ends at a
checkpoint resumes bit-exactly over the reference made again."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import _main_job
import _tokenizer_dirs as dirs
import _tol
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.numeric]  # main-job runs, two under torchrun

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BETA, LR = 3, 0.5, 0.5
RECORDS = [  # the first goes to validation (no other does), the 8 others make one step each
    {"prompt": "Say hi.", "chosen": " Hello there!", "rejected": " No."},
    {"prompt": "def add(a, b):", "chosen": "\n    return a + b\n", "rejected": "\n    return a - b\n"},
    {"prompt": "The quick brown fox", "chosen": " jumps over the lazy dog.", "rejected": " sleeps."},
    {"prompt": "What does json.dumps do?", "chosen": " It serializes an object.", "rejected": " Nothing"},
    {"prompt": "hello there,", "chosen": " how are you today?", "rejected": " what?"},
    {"prompt": "2+2=", "chosen": "4", "rejected": "5, or 17+25=42"},
    {"prompt": "You are a helpful assistant.", "chosen": " Yes, I am.", "rejected": " No"},
    {"prompt": "def sub(a, b):", "chosen": "\n    return a - b\n", "rejected": "\n    return b\n"},
    {"prompt": "The lazy dog", "chosen": " sleeps all day.", "rejected": " quick brown fox jumps"},
]
SGD = [
    "--config.optim.name=sgd",
    f"--config.optim.lr={LR}",
    "--config.optim.momentum=0",
    "--config.optim.clip=0",
    "--config.optim.schedule=constant",
    "--config.optim.warmup_steps=0",
    "--config.optim.weight_decay=0",
]
LORA = ["--config.lora.rank=8", "--config.lora.alpha=16", "--config.lora.targets=q_proj|v_proj"]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen2 directory: weights (transformers' init), a Qwen2.5-shaped tokenizer, and the pairs."""
    d = dirs.write(tmp_path_factory.mktemp("qwen2") / "base", "qwen2.5")
    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(d)
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return d


@pytest.fixture(scope="module")
def full(tmp_path_factory, base):
    """The full fine-tune's run, the reference a frozen copy: its metrics rows and its workdir (two tests read it)."""
    workdir = tmp_path_factory.mktemp("full") / "one"
    return _run(workdir, base), workdir


def _run(workdir, base_dir, *extra, nproc=1, log=None):
    """The main job on `configs/dpo.py` over `base_dir` (under torchrun when nproc > 1); its metrics rows (its
    output appended to `log`)."""
    launch = _main_job.command(nproc)
    args = [
        "--config=configs/dpo.py",
        f"--config.model.path={base_dir}",
        f"--config.data.path={base_dir / 'pairs.jsonl'}",
        "--config.data.val_fraction=0.000001",
        f"--workdir={workdir}",
        "--config.compile=False",
        "--config.lora.rank=0",
        "--config.batch_size=8",
        "--config.accum_steps=2",
        f"--config.steps={STEPS}",
        "--config.epochs=0",
        f"--config.preference.beta={BETA}",
        "--config.model.block_size=64",
        "--config.log_every=1",
        "--config.eval_every=1000",
        "--config.sample.max_new_tokens=4",
        "--config.dist_timeout_s=600",
        *SGD,
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run([*launch, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}", pytrace=False)
    if log is not None:
        log.append(out.stdout + out.stderr)
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _trl(base_dir, out, lora: bool):
    """DPOTrainer over the same directory and pairs in the same order, plain SGD at a constant rate, no clipping;
    returns (training log rows, the held-out evaluation, the final weights by name)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    reference = None if lora else copy.deepcopy(model)
    if lora:
        import peft

        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
        model.save_pretrained(out / "peft")  # the adapters functrain starts from (A drawn by peft, B zero)
    args = DPOConfig(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        optim="sgd", train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, bf16=False, dataloader_num_workers=0, seed=0, disable_tqdm=True, beta=BETA,
        loss_type=["sigmoid"], max_length=None, per_device_eval_batch_size=1,
    )  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(str(base_dir))
    trainer = DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(RECORDS[1:]),
        eval_dataset=Dataset.from_list(RECORDS[:1]),
        processing_class=tok,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    held_out = trainer.evaluate()
    final = model.merge_and_unload() if lora else model
    return logs, held_out, {k: v.detach() for k, v in final.state_dict().items()}


def _check(ours: list, theirs: list, held_out: dict, weights: dict, got_dir, tol: float):
    """functrain's rows and exported weights against TRL's log, evaluation and weights."""
    train = [r for r in ours if "loss" in r]
    assert len(train) == len(theirs) == STEPS
    for name in METRICS:
        got, want = np.array([r[name] for r in train]), np.array([h[name] for h in theirs])
        scale = float(np.abs([r["logps/chosen"] for r in train]).max())  # (rewards are 0 at the first step)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=name)
    assert [r["rewards/accuracies"] for r in train] == pytest.approx([h["rewards/accuracies"] for h in theirs])
    (val,) = [r for r in ours if "val_loss" in r]
    summary = json.loads((got_dir.parent / "summary.json").read_text())  # (what the run prints at its end)
    assert summary["val_rewards/margins"] == val["val_rewards/margins"]
    assert val["val_loss"] == pytest.approx(held_out["eval_loss"], rel=tol)
    for name in ("rewards/margins", "logps/chosen", "rewards/accuracies"):
        assert val[f"val_{name}"] == pytest.approx(held_out[f"eval_{name}"], rel=tol, abs=tol * scale), name
    exported = load_file(str(got_dir / "model.safetensors"))
    _tol.assert_close({k: exported[k] for k in exported}, {k: weights[k] for k in exported}, tol)


def test_full_fine_tuning_equals_trl_on_one_or_two_ranks_and_resumes(tmp_path, base, full):
    theirs, held_out, weights = _trl(base, tmp_path / "trl", lora=False)
    ours, workdir = full
    tol = _tol.rtol(8 * 64 * 32 * STEPS)
    _check(ours, theirs, held_out, weights, workdir / "hf", tol)
    two = _run(tmp_path / "two", base, "--config.mesh.dp_shard=2", nproc=2)  # the reference sharded as the params
    for a, b in zip(ours, two, strict=True):  # (validation: rank 0 holds the held-out pair, rank 1 none)
        for name in [n for n in a if n in METRICS or n.startswith("val_")]:
            assert b[name] == pytest.approx(a[name], rel=tol, abs=tol * abs(a.get("logps/chosen", 1.0))), name
    _run(tmp_path / "killed", base, "--config.stop_at=2")  # (a checkpoint, then the process ends)
    resumed = _run(tmp_path / "killed", base)  # the reference made again and checked against its digest
    assert _losses(resumed) == _losses(ours)


def test_reference_log_probs_computed_beforehand_equal_the_frozen_copy(tmp_path, base, full):
    """(c) = (a): `preference.precompute_reference=True` (the log-probs in the batches, no copy in the state) trains
    as the frozen copy does; on 2 ranks (each computes half the pairs' log-probs) as on one process, and a resume
    on one process reads the log-probs the 2 ranks kept."""
    pre = ["--config.preference.precompute_reference=True"]
    (copy_rows, _), logs = full, []
    ours = _run(tmp_path / "pre", base, *pre, log=logs)
    assert "reference: log-probs of 9 pairs computed" in logs[-1]
    tol = _tol.rtol(8 * 64 * 32 * STEPS)
    for a, b in zip(copy_rows, ours, strict=True):
        for name in [n for n in a if n in METRICS or n.startswith("val_")]:
            assert b[name] == pytest.approx(a[name], rel=tol, abs=tol * abs(a.get("logps/chosen", 1.0))), name
    _run(tmp_path / "killed", base, *pre, "--config.stop_at=2", "--config.mesh.dp_shard=2", nproc=2, log=logs)
    assert "reference: log-probs of 9 pairs computed" in logs[-1]
    resumed = _run(tmp_path / "killed", base, *pre, log=logs)
    assert "reference: log-probs of every pair read from" in logs[-1]
    got, want = _losses(resumed), _losses(ours)
    assert list(got) == list(want) and np.allclose(list(got.values()), list(want.values()), rtol=tol), (got, want)


def _losses(rows: list) -> dict:
    """{step: loss} of a run's training rows (a resumed run's file holds both processes' rows)."""
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_lora_equals_trl_with_a_peft_model(tmp_path, base):
    theirs, held_out, weights = _trl(base, tmp_path / "trl", lora=True)
    ours = _run(tmp_path / "lora", base, *LORA, f"--config.lora.init_from={tmp_path / 'trl' / 'peft'}")
    _check(ours, theirs, held_out, weights, tmp_path / "lora" / "hf", _tol.rtol(8 * 64 * 32 * STEPS))
