"""Benchmark: evaluation throughput against the training forward and against lm-eval's HFLM, side by side.

    python bench/eval.py [--examples 500] [--batch 32] [--repeats 3] [--json]

The model is the default run's GPT shape (4 layers, d=128, block 128) over a byte-level tokenizer of
257 ids (`train_bpe(..., 257)`: the 256 bytes and <|endoftext|>, no merges, so Hugging Face's
tokenizer class reads it too); the requests are the built-in `next_lines` task's (`--examples` x 4
rows) from the standard library's validation files. Timed, after one warm-up pass each:

* `functrain.eval` compiled (`Scorer(compile=True)`, one graph per bucket) and eager;
* the training forward: the compiled eval step (`make_eval_step`, the same model, full (batch, 128)
  windows), in tokens per second;
* lm-eval's `HFLM` on the model's Hugging Face export (float32, CPU, the same batch and length).

Printed: scored (continuation) tokens per second and forward tokens per second (padding included)
per engine, and the ratios functrain compiled / HFLM and functrain compiled / training forward. With
`--json` the last line is one JSON object. Measured: docs/results.md ("bench/eval.py").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from functrain import data as data_lib
from functrain import eval as fe
from functrain import init_state, make_eval_step, optim, rng
from functrain.eval import choice, next_lines
from functrain.interop.hf import save_hf_directory
from functrain.models import inference
from functrain.models.gpt import make_loss_fn
from functrain.models.gpt import model as gpt_lib
from functrain.models.gpt.hf import export_hf_gpt2, hf_gpt2_config

BLOCK = 128


def _timed(fn, repeats: int) -> float:
    """The best wall time of `repeats` calls of `fn` (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _hflm(directory, tokenizer_path, batch: int):
    """lm-eval's HFLM on the exported directory (float32, CPU)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_path), eos_token=data_lib.END_OF_TEXT, pad_token=data_lib.END_OF_TEXT
    )
    return HFLM(
        pretrained=str(directory), tokenizer=tok, max_length=BLOCK, batch_size=batch, device="cpu", dtype="float32"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from lm_eval.api.instance import Instance

    with tempfile.TemporaryDirectory() as tmp:
        docs = list(data_lib.validation_documents("stdlib"))
        tok = data_lib.train_bpe(docs[:20], 257, f"{tmp}/bytes.json")
        cfg = gpt_lib.GPTConfig(
            vocab_size=tok.vocab_size, block_size=BLOCK, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False
        )
        with torch.device("meta"):
            template = gpt_lib.GPT(cfg)
        params = gpt_lib.init_params(template, rng.key(0))
        model = inference.eval_model(
            template, tok, block_size=BLOCK, stages=gpt_lib.stages(template), head="wte.weight"
        )
        examples = next_lines.build(docs, tok, block_size=BLOCK, n=args.examples)
        rows = choice.rows_of(examples, model)
        pairs = [(e.context, e.delimiter + c) for e in examples for c in e.choices]
        scored = sum(r.scored for r in rows)
        real = sum(len(r.tokens) - 1 for r in rows)
        out = {"rows": len(rows), "scored_tokens": scored, "input_tokens": real}

        for name, compile_ in (("functrain_compiled", True), ("functrain_eager", False)):
            scorer = fe.Scorer(model, batch_size=args.batch, compile=compile_)
            dt = _timed(lambda scorer=scorer: fe.loglikelihood(model, params, pairs, scorer=scorer), args.repeats)
            out[name] = {"s": dt, "scored_per_s": scored / dt, "input_per_s": real / dt}

        directory = save_hf_directory(
            f"{tmp}/hf", export_hf_gpt2(params, cfg), hf_gpt2_config(cfg), tokenizer_file=tok.path
        )
        hflm = _hflm(directory, tok.path, args.batch)
        instances = [Instance("loglikelihood", {}, pr, i) for i, pr in enumerate(pairs)]
        dt = _timed(lambda: hflm.loglikelihood(instances, disable_tqdm=True), args.repeats)
        out["hflm"] = {"s": dt, "scored_per_s": scored / dt, "input_per_s": real / dt}

        step = make_eval_step(make_loss_fn(template), compile=True)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (args.batch, BLOCK), generator=g)
        state = init_state(params, optim.sgd(0.0))
        n_batches = max(1, real // (args.batch * BLOCK))
        dt = _timed(lambda: [float(step(state, (x, x))["loss"]) for _ in range(n_batches)], args.repeats)
        out["train_forward"] = {"s": dt, "input_per_s": n_batches * args.batch * BLOCK / dt}

    c, h, t = out["functrain_compiled"], out["hflm"], out["train_forward"]
    print(
        f"{len(rows)} rows ({args.examples} next_lines examples x 4), {scored:,} scored tokens, {real:,} input tokens; "
        f"batch {args.batch}, block {BLOCK}, {torch.get_num_threads()} threads"
    )
    print(f"{'engine':<22}{'seconds':>10}{'scored tok/s':>16}{'input tok/s':>16}")
    for name in ("functrain_compiled", "functrain_eager", "hflm", "train_forward"):
        r = out[name]
        print(f"{name:<22}{r['s']:>10.3f}{r.get('scored_per_s', float('nan')):>16,.0f}{r['input_per_s']:>16,.0f}")
    out["compiled_over_hflm"] = c["scored_per_s"] / h["scored_per_s"]
    out["compiled_over_train_forward"] = c["input_per_s"] / t["input_per_s"]
    print(
        f"functrain compiled / HFLM: {out['compiled_over_hflm']:.2f}x scored tokens/s; compiled eval input tokens/s / "
        f"training forward tokens/s: {out['compiled_over_train_forward']:.2f}"
    )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
