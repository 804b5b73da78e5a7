"""One rank of the per-rank memory-cap scenario (launched by test_memory_cap.py).

Usage: python tests/_memcap_worker.py <cap_mib> <outdir>

After the process group is up, the process caps its own heap: RLIMIT_DATA (every private writable
mapping: malloc'd and mmap'd tensor storage alike) = what it uses now + <cap_mib>. Then it builds
the training state of an 8 x 512 GPT (25.5M params: 102 MB of fp32 params, 307 MB with AdamW's two
moments) shard by shard (`parallel.init_sharded`), and trains 2 steps with the staged loss, remat
"full": each block's parameters are gathered before its forward, let go after it and gathered again
for its backward, its gradients reduce-scattered as soon as they exist. The step runs eagerly (a
cold compile of this model takes minutes on a CPU), so the functional optimizer's temporaries
(each transform of the chain makes a new tree) add ~2x the local state at the update. Measured
(torch 2.13, 2-core EPYC, MALLOC_MMAP_THRESHOLD_=131072 so freed tensors leave the heap): one
process rests at 407 MB and peaks above 1,048 MB (fails under a 1,000 MiB cap); each of 2 ranks
rests at 204 MB and peaks between 545 and 587 MB (passes under 560 MiB, fails under 520). An
allocation beyond the cap fails (MemoryError or RuntimeError "can't allocate memory") and
<outdir>/world<N>_rank<r>.json says so.
"""

from __future__ import annotations

import json
import resource
import sys
import traceback

import torch

from functrain import init_state, make_train_step, optim, parallel, rng, tree
from functrain.models import gpt

CFG = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=512, bias=False)


def _vm_data_bytes() -> int:
    """The process's data segment now (VmData: what RLIMIT_DATA counts)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def main() -> None:
    cap_mib, outdir = int(sys.argv[1]), sys.argv[2]
    ctx = parallel.setup({"dp_shard": -1}, mesh_on_single_process=True)
    with torch.device("meta"):
        template = gpt.GPT(CFG)
    loss_fn = gpt.make_loss_fn(template, remat="full", staged=True)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (2 * ctx.dp_world, CFG.block_size + 1), generator=g)
    rows = slice(2 * ctx.dp_rank, 2 * ctx.dp_rank + 2)  # this rank's 2 sequences
    batch = (x[rows, :-1], x[rows, 1:])
    step = make_train_step(loss_fn, opt, compile=False)
    cap = _vm_data_bytes() + cap_mib * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    out = {"rank": ctx.rank, "world": ctx.dp_world, "params": gpt.num_params(CFG)}
    try:
        params = parallel.init_sharded(
            lambda k, d, where: gpt.init_params(template, k, device=d, where=where), rng.key(0), ctx.mesh
        )
        state = init_state(params, opt)
        out["local_state_mb"] = (
            sum(
                t.to_local().numel() * 4 for t in tree.leaves((state.params, state.opt_state)) if hasattr(t, "to_local")
            )
            / 1e6
        )
        losses, base = [], cap - cap_mib * 2**20
        out["data_mb"] = [(_vm_data_bytes() - base) / 1e6]
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            out["data_mb"].append((_vm_data_bytes() - base) / 1e6)
        out.update(ok=True, losses=losses)
    except (MemoryError, RuntimeError) as e:  # the cap: "can't allocate memory" / "DefaultCPUAllocator"
        out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}", trace=traceback.format_exc()[-1500:])
    json.dump(out, open(f"{outdir}/world{ctx.dp_world}_rank{ctx.rank}.json", "w"))
    parallel.teardown()


if __name__ == "__main__":
    main()
