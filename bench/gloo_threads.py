"""Reproduces torch's gloo heap corruption: two collectives of one group in flight at once.

Why functrain builds its gloo groups with one worker thread (`functrain.parallel.gloo`). Plain
torch.distributed, no functrain model: on a 2 x 2 mesh (dp_shard, tp), each iteration starts one
all-gather on the dp group and, while it is in flight, issues and waits four small all-gathers on
the same group (a tp all-reduce after each), then waits the first. `--threads` sets the gloo worker
threads of every group (torch's default is 2; torch.distributed cannot pass it: the groups are built
by `functrain.parallel.gloo.backend(threads)`, 1 or 2 threads alike).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 bench/gloo_threads.py --threads 2
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 bench/gloo_threads.py --threads 1

Prints per rank `threads T iterations N seconds S`, or dies: with 2 threads a rank aborts with
"malloc(): unaligned tcache chunk detected" or a segfault inside a gloo worker thread
(`AsyncAllgatherCoalescedWork::allgather_coalesced`, seen with gdb on the core dump).

Measured: docs/results.md ("bench/gloo_threads.py").
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from functrain.parallel import gloo


def _wait(x):
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="gloo worker threads per group (torch: 2)")
    ap.add_argument("--iterations", type=int, default=6000)
    ap.add_argument("--no-overlap", action="store_true", help="wait the first all-gather before the others")
    args = ap.parse_args()
    dist.init_process_group(gloo.backend(args.threads))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    threads = {gloo.threads_of(mesh.get_group(i)) for i in range(2)}
    torch.manual_seed(0)
    weights = [distribute_tensor(torch.randn(rows, 32), mesh, [Shard(1), Shard(0)]) for rows in (32, 32, 32, 128)]
    flat = torch.randn(4000)
    t0 = time.perf_counter()
    for _ in range(args.iterations):
        first = funcol.all_gather_single(flat, 0, (mesh, 0))
        if args.no_overlap:
            first = _wait(first)
        for w in weights:
            local = w.to_local().t().contiguous()  # (cols / dp, rows / tp): gathered dim first
            full = _wait(funcol.all_gather_single(local, 0, (mesh, 0)))  # (cols, rows / tp)
            _wait(funcol.all_reduce(full[:4].sum(0), "sum", (mesh, 1)))
        _wait(first)
    print(
        f"rank {dist.get_rank()}: threads {sorted(threads)} iterations {args.iterations} "
        f"seconds {time.perf_counter() - t0:.1f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
