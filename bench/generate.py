"""Benchmark: generation through the KV cache against transformers' `generate` and the recompute path, side by side.

    python bench/generate.py [--json] [--batches 1,16] [--prompts 64,512] [--new 256] [--families gpt,llama]

Per case (family, batch, prompt length, new tokens), greedy, every row `--new` tokens (no EOS), timed after one
warm-up call each (the compiles):

* functrain: `functrain.generation.generator.Generator`, compiled (a prefill graph per bucket, one decode graph);
* transformers on the family's export (float32): `generate` with its dynamic cache, eager, and with a static
  cache and `torch.compile`d forward (its documented fast path); `vs_transformers` is over the faster of the two;
* the recompute path (`functrain.models.inference.generate`: the whole context again for every token).

Models: the gpt family at the default run's shape (4 layers, d=128) and a llama of Qwen2's build (grouped-query
attention, q/k/v biases, tied head), both with a 1024-token block; random weights at 8x the init's scale, so
greedy picks are not near-ties of rounding and `greedy_equal` (functrain's tokens == transformers') is a check.

With `--json` one line per case: {"case", "tokens_per_s", "vs_transformers", "vs_recompute", "greedy_equal"}.
Measured: docs/results.md ("bench/generate.py").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import transformers

from functrain import rng
from functrain.generation import Generator
from functrain.interop.hf import save_hf_directory
from functrain.models import gpt, inference, llama

BLOCK, VOCAB = 1024, 512


def _models():
    """{family: (template, cfg, params, export state dict, export config)}."""
    g = gpt.GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=4, n_head=4, n_embd=128)
    q = llama.LlamaConfig(
        vocab_size=VOCAB,
        block_size=BLOCK,
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        n_embd=128,
        intermediate_size=352,
        attention_bias=True,
        tie_embeddings=True,
    )
    out = {}
    for family, cfg, lib, cls in (("gpt", g, gpt, gpt.GPT), ("llama", q, llama, llama.Llama)):
        with torch.device("meta"):
            template = cls(cfg)
        params = {n: t * 8 if t.ndim == 2 else t for n, t in lib.init_params(template, rng.key(0)).items()}
        if family == "gpt":
            export = gpt.export_hf_gpt2(params, cfg), gpt.hf_gpt2_config(cfg)
        else:
            export = llama.export_hf_llama(params, cfg), llama.hf_llama_config(cfg)
        out[family] = (template, params, export)
    return out


def _best(fn, repeats: int = 2) -> tuple[float, object]:
    """(the best wall time of `repeats` calls after a warm-up call, the last result)."""
    result = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def _transformers(directory: str, ids: torch.Tensor, new: int) -> tuple[float, list]:
    """transformers' best time of dynamic-cache eager and static-cache compiled greedy `generate`, its tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dynamic, out = _best(lambda: model.generate(ids, **kw))
        model.forward = torch.compile(model.forward, fullgraph=True)
        static, _ = _best(lambda: model.generate(ids, cache_implementation="static", **kw))
    return min(dynamic, static), out[:, ids.shape[1] :].tolist()


def _row(family: str, model: tuple, batch: int, length: int, new: int) -> dict:
    """One case's measurements: `model` is (template, params, export directory)."""
    template, params, directory = model
    gen = Generator.of(template, batch_size=batch, block_size=length + new, compile=True)  # (static: prompt + new)
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))  # (B, P)
    prompts = ids.tolist()
    ours, done = _best(lambda: gen(params, prompts, new))
    theirs, want = _transformers(directory, ids, new)
    recompute, _ = _best(lambda: inference.generate(template, params, ids, new, temperature=0, key=rng.key(0)), 1)
    return {
        "case": f"{family} batch={batch} prompt={length} new={new}",
        "tokens_per_s": round(batch * new / ours, 1),
        "vs_transformers": round(theirs / ours, 2),
        "vs_recompute": round(recompute / ours, 2),
        "greedy_equal": [c.tokens for [c] in done] == want,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line per case")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompts", default="64,512")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--families", default="gpt,llama")
    args = p.parse_args()
    models = _models()
    for family in args.families.split(","):
        template, params, (state, config) = models[family]
        with tempfile.TemporaryDirectory() as tmp:
            model = (template, params, str(save_hf_directory(f"{tmp}/export", state, config)))
            for batch in map(int, args.batches.split(",")):
                for length in map(int, args.prompts.split(",")):
                    row = _row(family, model, batch, length, args.new)
                    print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
