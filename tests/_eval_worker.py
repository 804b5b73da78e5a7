"""One rank of the sharded evaluation check (launched by test_eval.py on 2 gloo ranks).

Usage: python tests/_eval_worker.py <outdir>

The tiny GPT's params are FSDP-sharded over the ranks (dp_shard=2); 7 multiple-choice examples (28 rows: an
odd number of batches of 3, so the ranks' shares differ), rolling texts, greedy and sampled generations are
split over the ranks and gathered (generation through the KV cache and with the cache off, recomputed: a
stage gathered at a time either way; a model without stages: gathered whole once, through its cache). The
same calls on the plain params in this process alone (before the mesh exists) are the reference; both go to
<outdir>/rank<r>.json, with the time of a longer generation each way on the ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from functrain import data as data_lib
from functrain import eval as fe
from functrain import parallel, rng
from functrain.eval import choice
from functrain.models import inference
from functrain.models.gpt import model as gpt_lib

TEXTS = ["def f(x):\n    return x + 1\n" * 3, "import sys\n", "class A:\n    pass\n" * 5]
GEN = [
    ("def g(", {"until": [")"], "max_gen_toks": 5}),
    ("x = ", {"until": ["\n"], "max_gen_toks": 7}),
    ("for i in", {"max_gen_toks": 4}),
]


SAMPLED = [(p, {"until": ["\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 0.9}) for p in TEXTS[:2] * 3]


def _examples() -> list:
    """7 questions of 4 choices."""
    ctx = ["def f(x):\n", "import os\n", "class A:\n", "if x:\n", "while True:\n", "try:\n", "with open(p) as f:\n"]
    return [
        choice.Example(c, ("    return x\n", "    pass\n", "print(1)\n", "    break\n"), i % 4, f"t:{i}")
        for i, c in enumerate(ctx)
    ]


def _run(model, params) -> dict:
    """Every call's results on `params`."""
    examples = _examples()
    scorer = fe.Scorer(model, batch_size=3)
    rows = choice.rows_of(examples, model)
    scores, _ = scorer.score(params, rows)
    return {
        "scores": scores.tolist(),
        "counts": choice.evaluate(model, params, examples, scorer=scorer),
        "rolling": fe.loglikelihood_rolling(model, params, TEXTS, scorer=scorer),
        "generated": fe.generate_until(model, params, GEN, scorer=scorer),
        "sampled": fe.generate_until(model, params, SAMPLED, key=rng.key(11), scorer=scorer),
        "recomputed": fe.generate_until(model._replace(cached=None), params, SAMPLED, key=rng.key(11)),
    }


def _timed(model, params) -> dict:
    """Seconds of 4 greedy generations of 24 tokens through the cache and recomputed (a stage gathered at a time
    for every token either way), and through the cache on the params gathered whole once."""
    requests = [(t[:12], {"max_gen_toks": 24}) for t in TEXTS + TEXTS[:1]]
    out = {}
    for name, m in (("cached_s", model), ("recompute_s", model._replace(cached=None)), ("gathered_s", model)):
        start = time.perf_counter()
        fe.generate_until(m, parallel.gather(params) if name == "gathered_s" else params, requests)
        out[name] = round(time.perf_counter() - start, 3)
    return out


def main(outdir: str) -> None:
    cfg = gpt_lib.GPTConfig(vocab_size=256, block_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False)
    with torch.device("meta"):
        template = gpt_lib.GPT(cfg)
    full = {k: v * 4 if v.ndim > 1 else v for k, v in gpt_lib.init_params(template, rng.key(5)).items()}
    model = inference.eval_model(
        template,
        data_lib.ByteTokenizer(),
        block_size=cfg.block_size,
        stages=gpt_lib.stages(template),
        head="wte.weight",
    )
    single = _run(model, full)
    with parallel.setup({"dp_shard": -1}, timeout_s=300) as ctx:
        sharded = parallel.shard_params(full.items(), ctx.mesh)
        out = _run(model, sharded)
        out["sharded"] = all(parallel.is_dtensor(v) for v in sharded.values())
        out["examples"] = out["counts"]["examples"]
        out["timing"] = _timed(model, sharded)
        # a model without stages (an unstaged hf type's): gathered whole once per call, decoded through its cache
        unstaged = inference.eval_model(
            template, data_lib.ByteTokenizer(), block_size=cfg.block_size, stages=None, head=None
        )
        gathers, real = [], parallel.gather
        parallel.gather = lambda tree: gathers.append(len(tree)) or real(tree)
        try:
            out["unstaged_sampled"] = fe.generate_until(unstaged, sharded, SAMPLED, key=rng.key(11))
        finally:
            parallel.gather = real
        out["unstaged_gathers"] = gathers
        out.update({f"single_{k}": v for k, v in single.items()})
        Path(outdir).mkdir(parents=True, exist_ok=True)
        (Path(outdir) / f"rank{ctx.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(sys.argv[1])
