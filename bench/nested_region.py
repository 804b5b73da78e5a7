"""Why `torch.compiler.nested_compile_region` broke at 8 blocks, and what compiling blocks once would give.

    python bench/nested_region.py [--depths 2,8,32] [--width 64] [--json]

The one-graph route that DESIGN.md names for "compile time flat in depth": trace forward, loss and
backward into one graph with `torch._dynamo.config.trace_autograd_ops = True` and
`torch.autograd.grad`, the block wrapped in `nested_compile_region` so Dynamo traces it once and
reuses it. A prototype worked for 2 blocks and failed for 8 and 16 with "The differentiated Tensor at
index 0 appears to not have been used in the graph".

The cause (torch 2.13, `torch/_dynamo/variables/invoke_subgraph.py`): on a call it can serve from
its reuse cache, Dynamo "stamps out" the cached subgraph and makes the call's fake outputs with
`torch.empty_strided(..., requires_grad=True)`: leaves without a `grad_fn`. `trace_autograd_ops`
runs `torch.autograd.grad` on those fake tensors to learn which gradients exist, so every reused call
cuts the fake autograd graph: the loss no longer reaches the earlier blocks' inputs. The second call
is still traced (`TORCH_LOGS=+hierarchical_compile`: "reuse failed -- input 0 tensor metadata
mismatch": the first call's input does not require grad, the second's does), the third is served
from the cache ("cache hit ... reusing subgraph 'subgraph_1'"): 2 blocks work, 3 or more fail. The
FX graph itself is right; only the fake reachability is wrong. Upstream PR pytorch/pytorch#178777
(closed; not in 2.13's build) connects the stamped-out outputs to the call's inputs with a
zero-valued sum. This bench applies the same idea to its own process only (`_reuse_keeps_autograd`,
a patch of `stamp_out_subgraph`; functrain's library does not patch torch) to measure the route.

Each case runs in a fresh process (OMP_NUM_THREADS=1 unless set), with inductor's caches off and
the vector-ISA probe done before the clock starts: a residual stack of width-`--width` blocks
(layer norm, matmul, GELU, matmul back), loss = mean square of the output, gradients of every
block's weight; it prints the cold compile time of the first call and the largest difference of
the loss and gradients from eager.

  stock     torch as installed: nested_compile_region + trace_autograd_ops + autograd.grad
  patched   the same with the reuse fix above
  inlined   no region: every block inlined into the graph (what the one-graph step does today)

Measured (2-core EPYC, quiet, torch 2.13.0+cpu), `python bench/nested_region.py --json`:

  | depth | stock | patched s | inlined s | patched max diff | inlined max diff |
  |-------|-------|-----------|-----------|------------------|------------------|
  |     2 | ok    | 4.7       | 5.0       | 3.7e-08          | 3.7e-08          |
  |     8 | fails | 5.8       | 6.6       | 1.8e-07          | 1.8e-07          |
  |    32 | fails | 6.2       | 14.1      | 1.4e-06          | 1.4e-06          |

  patched: depth 32 / depth 2 = 1.32x; inlined: 2.83x. Stock torch at 8 and 32: "The
  differentiated Tensor at index 0 appears to not have been used in the graph".

In functrain: `make_train_step(..., compile="regions")` (`functrain.regions`) takes this route,
with the reuse fix applied while its step traces. This toy missed a second bug that the real GPT
block met (found 2026-11-25): inductor's memory planner frees and reuses the buffer of a block's
input while the forward region still returns it as a saved tensor for the backward (an output
aliasing an operand, not seen as one), e.g. for the loss's cotangent, so the backward reads a
clobbered input. With the loss returned as an output beside the gradients (as every train step
does), the 2-block GPT's gradients were off by 50-100% of their size for everything before the
last block's MLP under inductor, exact under aot_eager; this toy returns only gradients and so
never hit it. functrain compiles the regions step with `allow_buffer_reuse=False`
(tests/test_compile_regions.py fails without it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CASE = r"""
import json, sys, time
import torch
import torch._dynamo
import torch._inductor.config
from torch._inductor import cpu_vec_isa

mode, depth, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch._inductor.config.force_disable_caches = True
torch._dynamo.config.trace_autograd_ops = True
cpu_vec_isa.pick_vec_isa()  # once per process: not part of what is measured


def _reuse_keeps_autograd():
    # The idea of pytorch#178777: a stamped-out call's fake outputs reach its inputs in autograd.
    import torch._dynamo.variables.invoke_subgraph as isg

    stamp = isg.stamp_out_subgraph

    def patched(tx, fingerprint, cached):
        ins = [p.node.meta.get("example_value") for p in isg.get_flat_proxies(fingerprint)]
        ins = [t for t in ins if isinstance(t, torch.Tensor) and t.requires_grad]
        empty = torch.empty_strided

        def connected(*args, requires_grad=False, **kwargs):
            out = empty(*args, **kwargs)
            if requires_grad and ins:
                return out + sum(t.sum() * 0 for t in ins)
            return out.requires_grad_(requires_grad)

        torch.empty_strided = connected
        try:
            return stamp(tx, fingerprint, cached)
        finally:
            torch.empty_strided = empty

    isg.stamp_out_subgraph = patched


if mode == "patched":
    _reuse_keeps_autograd()


def block(x, w):
    h = torch.nn.functional.layer_norm(x, (width,))
    return torch.nn.functional.gelu(h @ w) @ w.t() + x


if mode != "inlined":
    block = torch.compiler.nested_compile_region(block)


def step(x, ws):
    h = x
    for w in ws:
        h = block(h, w)
    loss = (h ** 2).mean()
    return loss.detach(), torch.autograd.grad(loss, ws)


torch.manual_seed(0)
ws = [(torch.randn(width, width) * width ** -0.5).requires_grad_() for _ in range(depth)]
x = torch.randn(32, width)
ref_loss, ref_grads = step(x, ws)
compiled = torch.compile(step, fullgraph=True)
t0 = time.perf_counter()
try:
    loss, grads = compiled(x, ws)
except Exception as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: " + str(exc).split("got RuntimeError(")[-1].splitlines()[0][:160]}))
    sys.exit(0)
seconds = time.perf_counter() - t0
diff = max([float((loss - ref_loss).abs())] + [float((g - r).abs().max()) for g, r in zip(grads, ref_grads)])
print(json.dumps({"ok": True, "compile_s": round(seconds, 2), "max_diff": diff}))
"""


def _case(mode: str, depth: int, width: int) -> dict:
    """One compile in a fresh process; returns what it printed (ok, compile_s, max_diff or error)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run([sys.executable, "-c", _CASE, mode, str(depth), str(width)], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        return {"ok": False, "error": out.stderr.strip().splitlines()[-1][:200] if out.stderr.strip() else "crashed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="2,8,32")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--json", action="store_true", help="end with one JSON line of every result")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    rows = {d: {m: _case(m, d, args.width) for m in ("stock", "patched", "inlined")} for d in depths}
    print("| depth | stock | patched s | inlined s | patched max diff | inlined max diff |")
    print("|---|---|---|---|---|---|")
    for d, r in rows.items():
        stock = "ok" if r["stock"]["ok"] else "fails"
        cells = [f"{r[m]['compile_s']:.1f}" if r[m]["ok"] else "fails" for m in ("patched", "inlined")]
        diffs = [f"{r[m]['max_diff']:.1e}" if r[m]["ok"] else "-" for m in ("patched", "inlined")]
        print(f"| {d} | {stock} | {cells[0]} | {cells[1]} | {diffs[0]} | {diffs[1]} |")
    for d, r in rows.items():
        if not r["stock"]["ok"]:
            print(f"stock torch at depth {d}: {r['stock']['error']}")
    first, last = depths[0], depths[-1]
    ratios = {m: rows[last][m]["compile_s"] / rows[first][m]["compile_s"]
              for m in ("patched", "inlined") if rows[first][m]["ok"] and rows[last][m]["ok"]}
    for m, ratio in ratios.items():
        print(f"{m}: compile time at depth {last} / depth {first} = {ratio:.2f}x")
    if args.json:
        print(json.dumps({"depths": depths, "results": {str(d): r for d, r in rows.items()},
                          "ratio": {m: round(v, 3) for m, v in ratios.items()}}))


if __name__ == "__main__":
    main()
