"""Benchmark: generation through the KV cache against transformers' `generate` and the recompute path, side by side.

    python bench/generate.py [--json] [--batches 1,16] [--prompts 64,512] [--new 256] [--families gpt,llama,qwen2]
                             [--tokens-per-call K]

Per case (family, batch, prompt length, new tokens), greedy, every row `--new` tokens (no EOS), timed after one
warm-up call each (the compiles):

* functrain: `functrain.generation.generator.Generator`, compiled (a prefill graph per bucket, one decode graph of
  `--tokens-per-call` steps, the Generator's default 4);
* transformers on the family's export (float32): `generate` with its dynamic cache, eager, and with a static
  cache and `torch.compile`d forward (its documented fast path); `vs_transformers` is over the faster of the two;
* the recompute path (`functrain.models.inference.generate`: the whole context again for every token).

Models: the gpt family at the default run's shape (4 layers, d=128), a llama of Qwen2's build (grouped-query
attention, q/k/v biases, tied head) and the hf family's Qwen2 of the same shape (transformers' own modules
through `hf.cached_model`'s slot cache), each with a 1024-token block; random weights at 8x the init's scale,
so greedy picks are not near-ties of rounding and `greedy_equal` (functrain's tokens == transformers') is a check.

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
from functrain.models import gpt, hf, inference, llama
from functrain.models.hf.tiny import write_tiny

BLOCK, VOCAB = 1024, 512


def _models(tmp: str) -> dict:
    """{family: (its `CachedModel`, params, the transformers directory of the same weights, recompute(ids, new))}."""
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
        params = _spread(lib.init_params(template, rng.key(0)))
        if family == "gpt":
            state, config = gpt.export_hf_gpt2(params, cfg), gpt.hf_gpt2_config(cfg)
        else:
            state, config = llama.export_hf_llama(params, cfg), llama.hf_llama_config(cfg)
        directory = str(save_hf_directory(f"{tmp}/{family}", state, config))
        out[family] = (Generator.of(template).model, params, directory, _recompute(template, params))
    shape = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4)
    shape.update(num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=BLOCK, tie_word_embeddings=True)
    directory = write_tiny(f"{tmp}/qwen2", "qwen2", **shape, bos_token_id=None, eos_token_id=None)
    template = hf.build_template(hf.load_config(directory))
    params = _spread(hf.init_params(template, rng.key(0)))
    save_hf_directory(directory, params, json.loads((directory / "config.json").read_text()))
    recompute = _recompute(template, params, logits_fn=hf.eval_logits(template), block_size=BLOCK)
    out["qwen2"] = (hf.cached_model(template), params, str(directory), recompute)
    return out


def _recompute(template, params, **kwargs):
    """`recompute(ids, new)`: the recompute path's greedy generation (`kwargs`: `inference.generate`'s)."""
    return lambda ids, new: inference.generate(template, params, ids, new, temperature=0, key=rng.key(0), **kwargs)


def _spread(params: dict) -> dict:
    """Weights 8x the init's scale: confident logits, so greedy picks are not near-ties of rounding."""
    return {n: t * 8 if t.ndim == 2 else t for n, t in params.items()}


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


def _row(family: str, model: tuple, batch: int, length: int, new: int, per_call: int | None) -> dict:
    """One case's measurements: `model` is `_models`' (cached model, params, directory, recompute)."""
    cached, params, directory, recompute = model
    torch._dynamo.reset()  # each case compiles afresh (transformers' forward would hit Dynamo's recompile limit)
    gen = Generator(cached, batch_size=batch, block_size=length + new, tokens_per_call=per_call)  # (prompt + new)
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))  # (B, P)
    prompts = ids.tolist()
    ours, done = _best(lambda: gen(params, prompts, new))
    theirs, want = _transformers(directory, ids, new)
    slow, _ = _best(lambda: recompute(ids, new), 1)
    return {
        "case": f"{family} batch={batch} prompt={length} new={new}",
        "tokens_per_s": round(batch * new / ours, 1),
        "vs_transformers": round(theirs / ours, 2),
        "vs_recompute": round(slow / ours, 2),
        "greedy_equal": [c.tokens for [c] in done] == want,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line per case")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompts", default="64,512")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--families", default="gpt,llama,qwen2")
    p.add_argument("--tokens-per-call", type=int, default=None, help="decode steps per call (default: the Generator's)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = _models(tmp)
        for family in args.families.split(","):
            for batch in map(int, args.batches.split(",")):
                for length in map(int, args.prompts.split(",")):
                    row = _row(family, models[family], batch, length, args.new, args.tokens_per_call)
                    print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
