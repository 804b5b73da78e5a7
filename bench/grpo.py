"""Benchmark: GRPO steps (sample, score, one dapo step) of functrain, eager and compiled, against TRL's
`GRPOTrainer` (`use_vllm=False`: transformers' generate) on the same model, prompts, completions per prompt and
lengths, side by side in one process.

    python bench/grpo.py [--steps 5] [--prompts 4] [--group 8] [--new 32] [--hidden 256] [--layers 4] [--json]

The prompts are `functrain.data.additions` records ("17+25="), tokenized by the byte-level BPE of 512 ids the SFT
benchmark trains (bench/sft.py); a Qwen2 of `--hidden` x `--layers` with the same init on both sides, AdamW at the
same rate, a reward of the completion's length (every completion of a fresh model runs to `--new` tokens on
both sides: the same work). Printed per run: the step time (after 2 warm-up steps: the compiles), the rollout's
share of it, and completion tokens per second of sampling; then `vs_trl` (TRL's step time over functrain's;
goal >= 1.5 compiled).

With `--json` the last line is one JSON object. Measured: docs/results.md ("bench/grpo.py").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from sft import _trl_setup  # (bench/sft.py: the tokenizer and model directory the benchmarks train)

from functrain import functional, generation, grpo, init_state, make_train_step, optim, rng
from functrain.data import HFTokenizer, additions
from functrain.interop.hf import HFDirectory
from functrain.models import hf


def length_reward(prompts, completions, **fields):
    """A completion's length in characters over 100 (every sample scored, their rewards apart)."""
    return [len(c) / 100 for c in completions]


def _functrain(args, tok_dir: str, model_dir: str, records: list[dict], *, compile: bool) -> dict:
    """functrain's GRPO step over the records' prompts: step time, the rollout's share, sampled tokens per second."""
    tok = HFTokenizer(tok_dir)
    template = hf.build_template(hf.load_config(model_dir))
    weights = HFDirectory(model_dir).weights
    params = {n: weights.read(n, [0] * p.ndim, list(p.shape)).float() for n, p in template.named_parameters()}
    logits = lambda p, x, key: functional.apply(template, p, input_ids=x, train=False).logits  # noqa: E731
    how = grpo.GRPO("dapo")
    opt = optim.adamw(args.lr, weight_decay=0.0)
    state = init_state(params, opt)
    step = make_train_step(grpo.make_loss_fn(logits, how), opt, count_targets=grpo.count_for(how), compile=compile)
    rows = args.prompts * args.group
    gen = generation.Generator(
        hf.cached_model(template), block_size=args.block, batch_size=rows, compile=compile
    )  # fmt: skip
    sampling, eos = generation.Sampling(1.0), [tok.eos_id]
    times, rollout, tokens = [], [], []
    for s in range(2 + args.steps):
        part = records[s * args.prompts : (s + 1) * args.prompts]
        prompts = [tok.encode(r["prompt"]).tolist() for r in part]
        t0 = time.perf_counter()
        samples = gen(state.params, prompts, args.new, key=rng.fold_in(rng.key(1), s), sampling=sampling,
                      n=args.group, eos_ids=eos)  # fmt: skip
        texts = [tok.decode(c.tokens) for g in samples for c in g]
        scores = grpo.score([length_reward], [r["prompt"] for r in part for _ in range(args.group)], texts, {})
        adv, _ = grpo.advantages(scores, torch.ones(1), args.group)
        x, y = grpo.completion_rows(prompts, samples, args.block)
        t1 = time.perf_counter()
        state, m = step(state, (x, y, adv))
        float(m["loss"])
        t2 = time.perf_counter()
        times.append(t2 - t0)
        rollout.append(t1 - t0)
        tokens.append(sum(len(c.tokens) for g in samples for c in g))
    dt, dr = sum(times[2:]), sum(rollout[2:])
    return {"step_s": dt / args.steps, "rollout_share": dr / dt, "sample_tokens_per_s": sum(tokens[2:]) / dr}


def _trl(args, tok_dir: str, model_dir: str, records: list[dict], tmp: str) -> dict:
    """TRL's GRPOTrainer on the same prompts, model and shapes: step time, and its generation's share of it."""
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    cfg = GRPOConfig(
        output_dir=f"{tmp}/trl", per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.new, max_steps=2 + args.steps, learning_rate=args.lr, weight_decay=0.0,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        bf16=False, dataloader_num_workers=0, seed=0, beta=0.0, loss_type="dapo", temperature=1.0,
        disable_tqdm=True, shuffle_dataset=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir, padding_side="left")
    data = Dataset.from_list(records[: (2 + args.steps) * args.prompts])
    trainer = GRPOTrainer(
        model=model, reward_funcs=[length_reward], args=cfg, train_dataset=data, processing_class=tok
    )  # fmt: skip
    generated: list[float] = []
    generate = trainer.model.generate

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        out = generate(*a, **k)
        generated.append(time.perf_counter() - t0)
        return out

    trainer.model.generate = timed_generate
    trainer.add_callback(Clock())
    trainer.train()
    dt = marks[-1] - marks[1]
    share = sum(generated[-args.steps :]) / dt if len(generated) >= args.steps else float("nan")
    return {"step_s": dt / args.steps, "rollout_share": share}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--new", type=int, default=32, help="new tokens per completion")
    p.add_argument("--block", type=int, default=40, help="functrain's rows (prompt + completion: 6 + 32 tokens)")
    p.add_argument("--hidden", type=int, default=256, help="the Qwen2's width")
    p.add_argument("--layers", type=int, default=4, help="its layers")
    p.add_argument("--examples", type=int, default=500, help="stdlib records the tokenizer is trained on")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    records = additions.records(200)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir, model_dir, _ = _trl_setup(tmp, args)
        rows = {f"functrain_{m}": _functrain(args, tok_dir, model_dir, records, compile=m == "compiled")
                for m in ("eager", "compiled")}  # fmt: skip
        rows["trl"] = _trl(args, tok_dir, model_dir, records, tmp)
    vs_trl = {m: rows["trl"]["step_s"] / rows[f"functrain_{m}"]["step_s"] for m in ("eager", "compiled")}
    print(f"{'run':20} {'step s':>8} {'rollout share':>14} {'sampled tok/s':>14}")
    for name, r in rows.items():
        rate = r.get("sample_tokens_per_s", float("nan"))
        print(f"{name:20} {r['step_s']:8.3f} {r['rollout_share']:14.2f} {rate:14.0f}")
    print("vs trl (its step time over ours): " + ", ".join(f"{k} {v:.2f}x" for k, v in vs_trl.items()))
    if args.json:
        print(json.dumps({"rows": rows, "vs_trl": vs_trl, "args": vars(args), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
