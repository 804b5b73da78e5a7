"""Cold compile time of the train step against depth: is it flat in the number of layers?

    python bench/compile_depth.py [--layers 2,6,12] [--n-embd 64] [--remat none] [--compile step|blocks]
                                  [--update] [--no-donate] [--json]

For each depth, a fresh subprocess (empty inductor and AOT caches in a temporary directory, so
nothing is reused between depths) builds a width-`--n-embd` GPT, its compiled AdamW train step
(`make_train_step`, the default job's route), and times the first step (trace + compile + one run)
and the second (one run); the cold compile time is their difference. Printed: one row per depth and
the ratio of the deepest to the shallowest; with `--json`, one JSON object as the last line
(`compile_s` per depth, `ratio`).

`--compile blocks` times `make_train_step(..., compile="blocks")` (a graph per stage kind, one block
graph for every block, the optimizer update block by block: `functrain.step.update.grouped_update`) instead of
the one-graph step. `--no-donate` builds the step with `donate=False`.
`--update` also times, in its own fresh process per depth, the cold compile of
the whole-tree optimizer update alone (`update_step`, the graph the one-graph step ends with): one
fused loop per parameter tensor, so it grows with depth.

The one-graph step inlines every block, so its compile time grows with depth (24 s at 1 layer, 49 s
at 4, 85 s at 8, caches off: docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import torch
from functrain import init_state, make_train_step, optim, rng
from functrain.models import gpt
n_layer, n_embd, remat, mode, donate = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
cfg = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=n_layer, n_head=4, n_embd=n_embd, dropout=0.0)
with torch.device("meta"):
    template = gpt.GPT(cfg)
params = gpt.init_params(template, rng.key(0))
opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-4, weight_decay=0.1))
state = init_state(params, opt)
if mode == "update":  # the optimizer update alone, on gradients of ones
    from functrain import tree, update_step
    upd, grads = update_step(opt), tree.map(torch.ones_like, params)
    step = lambda state, batch: upd(state, grads, {"loss": torch.ones(())})
else:
    step = make_train_step(gpt.make_loss_fn(template, remat=remat, staged=mode != "step"), opt,
                           compile=True if mode == "step" else mode, donate=donate)
g = torch.Generator().manual_seed(0)
batch = (torch.randint(0, 256, (4, 64), generator=g), torch.randint(0, 256, (4, 64), generator=g))
times = []
for _ in range(3):
    t = time.perf_counter()
    state, m = step(state, batch)
    float(m["loss"])
    times.append(time.perf_counter() - t)
print(json.dumps({"first": times[0], "step": min(times[1:])}))
"""


def _cold(n_layer: int, n_embd: int, remat: str, mode: str, donate: bool = True) -> dict:
    """First-step and steady step time of a fresh process with empty compile caches."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=cache,
            TORCHINDUCTOR_FX_GRAPH_CACHE="0",
            TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        )
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(n_layer), str(n_embd), remat, mode, str(int(donate))],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,6,12", help="comma-separated depths")
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--remat", default="none", help="remat policy of the loss (none, full, N)")
    ap.add_argument("--compile", default="step", choices=["step", "blocks"], help="what one graph covers")
    ap.add_argument("--update", action="store_true", help="also time the optimizer update's compile alone")
    ap.add_argument(
        "--no-donate",
        dest="donate",
        action="store_false",
        help="make_train_step(donate=False): the state's buffers not reused",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    print(
        f"cold compile of the GPT train step, width {args.n_embd}, remat={args.remat}, compile={args.compile}, "
        f"donate={args.donate}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    print(f"{'layers':>6} {'first step s':>13} {'step s':>8} {'compile s':>10}" + (f" {'update s':>9}" * args.update))
    compile_s, update_s = {}, {}
    for n in depths:
        r = _cold(n, args.n_embd, args.remat, args.compile, args.donate)
        compile_s[n] = r["first"] - r["step"]
        row = f"{n:>6} {r['first']:>13.1f} {r['step']:>8.3f} {compile_s[n]:>10.1f}"
        if args.update:
            u = _cold(n, args.n_embd, args.remat, "update")
            update_s[n] = u["first"] - u["step"]
            row += f" {update_s[n]:>9.1f}"
        print(row, flush=True)
    ratio = compile_s[depths[-1]] / compile_s[depths[0]]
    print(f"compile time ratio {depths[-1]} / {depths[0]} layers: {ratio:.2f}")
    out = {
        "compile_s": compile_s,
        "ratio": round(ratio, 3),
        "n_embd": args.n_embd,
        "remat": args.remat,
        "compile": args.compile,
        "donate": args.donate,
    }
    if args.update:
        without = {n: compile_s[n] - update_s[n] for n in depths}
        out.update(update_s=update_s, ratio_without_update=round(without[depths[-1]] / without[depths[0]], 3))
        print(f"without the update's compile: {out['ratio_without_update']:.2f}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
