"""Benchmark: preference tuning (DPO, sigmoid) of functrain, eager and compiled, against TRL's `DPOTrainer` on the
same model, pairs and batch, side by side in one process; a full fine-tune (the reference a frozen copy) and LoRA
(the reference the base with the adapters off), and the memory each reference costs.

    python bench/dpo.py [--steps 20] [--batch 8] [--block 256] [--hidden 256] [--layers 8] [--json]

The pairs are `stdlib:prompt_completion`'s records (the first `--examples`), the completion of the function
chosen over another function's, tokenized by a byte-level BPE of 512 ids trained on them; a Qwen2 of `--hidden` x
`--layers` with the same init on both sides, AdamW at the same rate, `--batch` pairs per step padded per batch.
Printed per run: the step time and pairs per second after the compiling / warm-up steps, and the state's memory
(params, frozen params, optimizer state: the bytes of its tensors) and the peak memory the state and the steps
add (RSS growth, eager); then `vs_trl` (functrain's pairs/s over TRL's, eager and compiled, full and LoRA),
`lora_reference` (the peak of LoRA with the adapters-off reference over the same LoRA steps with no reference
at all, its log-probs read from the batch: what the reference costs; goal <= 1.05) and `lora_vs_full`.

With `--json` the last line is one JSON object. Measured: docs/results.md ("bench/dpo.py").
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import _mem  # (bench/_mem.py: RSS readings)
import torch
from sft import _trl_setup  # (bench/sft.py: the tokenizer and model directory both benchmarks train)

from functrain import functional, init_state, make_train_step, optim, preference, rng
from functrain import tree as tree_lib
from functrain.data import Batching, HFTokenizer, Placement, sft_data
from functrain.interop.hf import HFDirectory
from functrain.models import hf
from functrain.nn import lora
from functrain.trainer.defaults import data_config


def _pairs(records: list[dict]) -> list[dict]:
    """Each record's completion chosen over the completion of the record half the list away."""
    half = len(records) // 2
    return [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": records[(i + half) % len(records)]["completion"]}
        for i, r in enumerate(records)
    ]


def _state_mib(state) -> float:
    """The bytes of every tensor the state holds (params, frozen params, optimizer state), in MiB."""
    leaves = tree_lib.leaves((state.params, state.frozen, state.opt_state))
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)) / 2**20


def _functrain(args, tok_dir: str, model_dir: str, pairs: list[dict], tmp: str, *, compile: bool, reference: str):
    """functrain's preference step on the pairs, its reference a frozen "copy", the LoRA base with the
    "adapters_off", or "none" (LoRA, the reference's log-probs in the batch, computed before): step time, pairs
    per second, the state's bytes and the peak memory the state and the steps add (RSS)."""
    Path(tmp).mkdir(parents=True, exist_ok=True)
    src = f"{tmp}/pairs.jsonl"
    Path(src).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    data = sft_data(
        data_config(path=src, val_fraction=0.02),
        Placement(f"{tmp}/data", log=lambda line: None),
        Batching(args.batch, args.block, seed=0, eval_batches=1),
        tokenizer=HFTokenizer(tok_dir),
        template=None,
    )
    batches = [data.train_batch(s) for s in range(2 + args.steps)]
    template = hf.build_template(hf.load_config(model_dir))
    weights = HFDirectory(model_dir).weights
    logits = lambda p, x, key: functional.apply(template, p, input_ids=x, train=False).logits  # noqa: E731
    _mem.trim()
    before = _mem.status_mib("VmRSS")
    _mem.reset_peak()
    params = {n: weights.read(n, [0] * p.ndim, list(p.shape)).float() for n, p in template.named_parameters()}
    opt = optim.adamw(args.lr, weight_decay=0.0)
    if reference == "copy":
        state, ref_fn = init_state(params, opt, frozen=preference.frozen_reference(params)), preference.reference_of
    else:
        template = lora.wrap(template, lora.LoraSpec(rank=8, alpha=16.0, targets="all-linear"))
        state = init_state(lora.init_adapters(template, rng.key(1)), opt, frozen=params)
        ref_fn = preference.adapters_off if reference == "adapters_off" else None
        if ref_fn is None:  # the reference's log-probs carried by each batch
            start = preference.adapters_off({**state.frozen, **state.params})
            batches = [(*b, preference.reference_logps(logits, start, b)) for b in batches]
    loss_fn = preference.make_loss_fn(logits, preference.Preference("sigmoid", 0.1), reference=ref_fn)
    step = make_train_step(loss_fn, opt, count_targets=preference.count_pairs(), compile=compile)
    timed = range(2, 2 + args.steps)
    warm = {int(batches[s][0].shape[-1]): s for s in reversed(timed)}  # a step of each row length
    for s in [0, 1, *warm.values()]:  # (compiled: one graph per row length, all made before the timing)
        state, m = step(state, batches[s])
    float(m["loss"])
    t0 = time.perf_counter()
    for s in timed:
        state, m = step(state, batches[s])
    float(m["loss"])
    dt = time.perf_counter() - t0
    peak = _mem.status_mib("VmHWM") - before
    return {
        "step_s": dt / args.steps,
        "pairs_per_s": args.batch * args.steps / dt,
        "state_mib": _state_mib(state),
        "peak_mib": peak,
    }


def _trl(args, tok_dir: str, model_dir: str, pairs: list[dict], tmp: str, *, lora_on: bool) -> dict:
    """TRL's DPOTrainer on the same pairs and model: step time and pairs per second (after 2 steps)."""
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    cfg = DPOConfig(
        output_dir=f"{tmp}/trl", per_device_train_batch_size=args.batch, max_steps=2 + args.steps,
        learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant", max_length=args.block + 1,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, bf16=False, dataloader_num_workers=0,
        seed=0, beta=0.1, loss_type=["sigmoid"], disable_tqdm=True,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = None if lora_on else copy.deepcopy(model)
    if lora_on:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=cfg, train_dataset=Dataset.from_list(pairs), processing_class=tok
    )
    trainer.add_callback(Clock())
    trainer.train()
    dt = marks[-1] - marks[1]
    return {"step_s": dt / args.steps, "pairs_per_s": args.batch * args.steps / dt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--examples", type=int, default=2000, help="records the pairs are made of")
    p.add_argument("--hidden", type=int, default=256, help="the Qwen2's width")
    p.add_argument("--layers", type=int, default=8, help="its layers")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = {}
    runs = [("full", "copy", ("eager", "compiled")), ("lora", "adapters_off", ("eager", "compiled"))]
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir, model_dir, records = _trl_setup(tmp, args)
        pairs = _pairs(records)
        for kind, reference, modes in [*runs, ("lora_no_reference", "none", ("eager",))]:
            for mode in modes:
                rows[f"functrain_{kind}_{mode}"] = _functrain(
                    args, tok_dir, model_dir, pairs, f"{tmp}/{kind}-{mode}", compile=mode == "compiled",
                    reference=reference,
                )  # fmt: skip
            if kind != "lora_no_reference":
                rows[f"trl_{kind}"] = _trl(args, tok_dir, model_dir, pairs, f"{tmp}/trl-{kind}", lora_on=kind == "lora")
    vs_trl = {
        f"{kind}_{mode}": rows[f"functrain_{kind}_{mode}"]["pairs_per_s"] / rows[f"trl_{kind}"]["pairs_per_s"]
        for kind in ("full", "lora")
        for mode in ("eager", "compiled")
    }
    # what the reference costs under LoRA: the peak of the adapters-off steps over the same steps with no reference
    lora_reference = rows["functrain_lora_eager"]["peak_mib"] / rows["functrain_lora_no_reference_eager"]["peak_mib"]
    lora_vs_full = rows["functrain_lora_eager"]["peak_mib"] / rows["functrain_full_eager"]["peak_mib"]
    print(f"{'run':34} {'step s':>8} {'pairs/s':>9} {'state MiB':>10} {'peak MiB':>9}")
    for name, r in rows.items():
        state, peak = r.get("state_mib", float("nan")), r.get("peak_mib", float("nan"))
        print(f"{name:34} {r['step_s']:8.4f} {r['pairs_per_s']:9.1f} {state:10.1f} {peak:9.1f}")
    print("vs trl (pairs/s): " + ", ".join(f"{k} {v:.2f}x" for k, v in vs_trl.items()))
    print(f"peak memory: LoRA, reference = adapters off, over LoRA with no reference: {lora_reference:.3f}x; "
          f"LoRA over the full fine-tune (its reference a copy): {lora_vs_full:.3f}x")  # fmt: skip
    if args.json:
        out = {"rows": rows, "vs_trl": vs_trl, "lora_reference": lora_reference, "lora_vs_full": lora_vs_full}
        out |= {"args": vars(args)}
        print(json.dumps(out | {"torch": torch.__version__}))


if __name__ == "__main__":
    main()
