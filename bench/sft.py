"""Benchmark: packed vs padded rows of the embedded fine-tuning set, side by side in one run; or (`--vs trl`)
functrain's padded rows, eager and compiled, against TRL's `SFTTrainer` on the same examples and model.

    python bench/sft.py [--steps 40] [--batch 16] [--block 256] [--compile 1] [--json]
    python bench/sft.py --vs trl [--steps 30] [--batch 16] [--block 256] [--hidden 256] [--layers 8] [--json]

The examples are `configs/sft.py`'s (`stdlib:messages`, the byte tokenizer, the tiny Qwen2 of
`functrain.models.hf.tiny`); each layout trains the same fresh model with the token-weighted step
(`count_targets`) for `--steps` timed steps after one compiling step. Printed per layout: steps per
epoch, the rows' fill (real tokens and target tokens over all tokens), the step time, and target
(supervised) tokens per second; then the packed / padded ratios of steps per epoch and of target
tokens per second (anchor: 1.4-2x in Hugging Face's packing measurements).

`--vs trl`: the prompt/completion records of `stdlib:prompt_completion` (the first `--examples`), a byte-level
BPE of 512 ids trained on them (its tokenizer_config.json names `<|endoftext|>` as EOS and PAD), a Qwen2 of
`--hidden` x `--layers` (6.5M params by default) with the same init on both sides, AdamW at the same rate,
`--batch` rows padded per batch (TRL: to the batch's longest example; functrain: that rounded up to its row
lengths), the completion learned. Printed: step time and target tokens per second of functrain eager, functrain
compiled and TRL, and `vs_trl` (functrain's target tokens/s over TRL's) of both functrain modes.

With `--json` the last line is one JSON object. Measured: docs/results.md ("bench/sft.py").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from functrain import init_state, make_train_step, optim, rng
from functrain.data import Batching, ByteTokenizer, HFTokenizer, Placement, chat_template_of, sft_data
from functrain.interop.hf import HFDirectory
from functrain.models import hf, lm
from functrain.models.hf.tiny import TINY, write_tiny
from functrain.trainer.defaults import data_config


def _measure(packing: bool, args, cache: str, model_dir: str) -> dict:
    """One layout's steps per epoch, fill, step time and target tokens per second."""
    cfg = data_config(path="stdlib:messages", packing=packing, val_fraction=0.02)
    data = sft_data(
        cfg,
        Placement(cache, log=lambda line: None),
        Batching(args.batch, args.block, seed=0, eval_batches=1),
        tokenizer=ByteTokenizer(),
        template=chat_template_of(None),
    )
    template = hf.build_template(hf.load_config(model_dir))
    opt = optim.adamw(1e-3)
    state = init_state(hf.init_params(template, rng.key(0)), opt)
    step = make_train_step(hf.make_loss_fn(template), opt, count_targets=lm.count_targets(), compile=bool(args.compile))
    state, m = step(state, data.train_batch(0))  # compiles
    float(m["loss"])
    targets, t0 = 0.0, time.perf_counter()
    for s in range(1, args.steps + 1):
        state, m = step(state, data.train_batch(s))
        targets += float(m["targets"])
    dt = time.perf_counter() - t0
    fill_targets, fill_tokens = data.efficiency()
    return {
        "steps_per_epoch": data.steps_per_epoch,
        "fill_tokens": fill_tokens,
        "fill_targets": fill_targets,
        "step_s": dt / args.steps,
        "targets_per_s": targets / dt,
        "loss": float(m["loss"]),
    }


def _trl_setup(tmp: str, args) -> tuple[str, str, list[dict]]:
    """(tokenizer directory, model directory with weights, records) shared by both sides of `--vs trl`."""
    import transformers

    from functrain.data import train_bpe
    from functrain.data.stdlib_sft import _record, stdlib_pairs

    records = [_record(p, "prompt_completion") for p in stdlib_pairs()[: args.examples]]
    tok = train_bpe((r["prompt"] + r["completion"] for r in records), 512, f"{tmp}/tok/tokenizer.json")
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (tok.path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    shape = dict(TINY, vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers)
    shape.update(intermediate_size=args.hidden * 11 // 4, max_position_embeddings=args.block, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**shape))
    model.save_pretrained(f"{tmp}/model")
    return str(tok.path.parent), f"{tmp}/model", records


def _functrain_padded(args, tok_dir: str, model_dir: str, records: list[dict], tmp: str, compile: bool) -> dict:
    """functrain's padded step on the records: step time and target tokens per second."""
    Path(tmp).mkdir(parents=True, exist_ok=True)
    src = f"{tmp}/records.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    data = sft_data(
        data_config(path=src, val_fraction=0.02),
        Placement(f"{tmp}/data", log=lambda line: None),
        Batching(args.batch, args.block, seed=0, eval_batches=1),
        tokenizer=HFTokenizer(tok_dir),
        template=None,
    )
    template = hf.build_template(hf.load_config(model_dir))
    weights = HFDirectory(model_dir).weights
    params = {n: weights.read(n, [0] * p.ndim, list(p.shape)).float() for n, p in template.named_parameters()}
    opt = optim.adamw(args.lr, weight_decay=0.0)
    state = init_state(params, opt)
    step = make_train_step(hf.make_loss_fn(template), opt, count_targets=lm.count_targets(), compile=compile)
    timed = range(2, 2 + args.steps)
    warm = {int(data.train_batch(s)[0].shape[1]): s for s in reversed(timed)}  # a step of each row length
    for s in [0, 1, *warm.values()]:  # (compiled: one graph per row length, all made before the timing)
        state, m = step(state, data.train_batch(s))
    float(m["loss"])
    targets, t0 = 0.0, time.perf_counter()
    for s in timed:
        state, m = step(state, data.train_batch(s))
        targets += float(m["targets"])
    dt = time.perf_counter() - t0
    return {"step_s": dt / args.steps, "targets_per_s": targets / dt}


def _trl_padded(args, tok_dir: str, model_dir: str, records: list[dict], tmp: str) -> dict:
    """TRL's SFTTrainer on the same records and model: step time and target tokens per second (after 2 steps)."""
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    marks: list[float] = []
    targets: list[int] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    cfg = SFTConfig(
        output_dir=f"{tmp}/trl",
        per_device_train_batch_size=args.batch,
        max_steps=2 + args.steps,
        learning_rate=args.lr,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_length=args.block,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        seed=0,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(records), processing_class=tok)
    collate = trainer.data_collator

    def counting(features):
        batch = collate(features)
        targets.append(int((batch["labels"] != -100).sum()))
        return batch

    trainer.data_collator = counting
    trainer.add_callback(Clock())
    trainer.train()
    dt = marks[-1] - marks[1]
    return {"step_s": dt / args.steps, "targets_per_s": sum(targets[2 : 2 + args.steps]) / dt}


def _vs_trl(args) -> None:
    """`--vs trl`: functrain padded (eager, compiled) and TRL side by side."""
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir, model_dir, records = _trl_setup(tmp, args)
        rows = {
            "functrain_eager": _functrain_padded(args, tok_dir, model_dir, records, f"{tmp}/e", compile=False),
            "functrain_compiled": _functrain_padded(args, tok_dir, model_dir, records, f"{tmp}/c", compile=True),
            "trl": _trl_padded(args, tok_dir, model_dir, records, tmp),
        }
    vs = {k: rows[k]["targets_per_s"] / rows["trl"]["targets_per_s"] for k in ("functrain_eager", "functrain_compiled")}
    print(f"{'run':20} {'step s':>8} {'targets/s':>10}")
    for name, r in rows.items():
        print(f"{name:20} {r['step_s']:8.4f} {r['targets_per_s']:10,.0f}")
    print(f"vs trl (target tokens/s): eager {vs['functrain_eager']:.2f}x, compiled {vs['functrain_compiled']:.2f}x")
    if args.json:
        print(json.dumps({"rows": rows, "vs_trl": vs, "args": vars(args), "torch": torch.__version__}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--vs", choices=["trl"], default=None, help="compare padded rows with TRL's SFTTrainer")
    p.add_argument("--examples", type=int, default=2000, help="--vs trl: records used")
    p.add_argument("--hidden", type=int, default=256, help="--vs trl: the Qwen2's width")
    p.add_argument("--layers", type=int, default=8, help="--vs trl: its layers")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.vs == "trl":
        return _vs_trl(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny(f"{tmp}/qwen2", "qwen2"))
        rows = {name: _measure(name == "packed", args, f"{tmp}/data", model_dir) for name in ("padded", "packed")}
    print(f"{'layout':8} {'steps/epoch':>11} {'tokens':>7} {'targets':>8} {'step s':>8} {'targets/s':>10}")
    for name, r in rows.items():
        print(
            f"{name:8} {r['steps_per_epoch']:11.1f} {100 * r['fill_tokens']:6.0f}% {100 * r['fill_targets']:7.0f}% "
            f"{r['step_s']:8.4f} {r['targets_per_s']:10,.0f}"
        )
    ratio = {
        "steps_per_epoch": rows["padded"]["steps_per_epoch"] / rows["packed"]["steps_per_epoch"],
        "targets_per_s": rows["packed"]["targets_per_s"] / rows["padded"]["targets_per_s"],
    }
    print(
        f"packed / padded: {ratio['steps_per_epoch']:.2f}x fewer steps per epoch, "
        f"{ratio['targets_per_s']:.2f}x target tokens per second"
    )
    if args.json:
        print(json.dumps({"rows": rows, "ratio": ratio, "args": vars(args), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
