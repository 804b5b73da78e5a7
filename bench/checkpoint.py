"""Checkpoint benchmark: functrain.checkpoint (TensorStore, Orbax layout) vs torch.distributed.checkpoint.

Measures, in one interleaved run (each repetition runs every method once, in turn):
  ours async save   blocking part (snapshot) and total (until committed); host snapshot buffers
                    reused between saves as Manager does by default, and fresh ones per save
  ours sync save    total
  ours restore      blocking part (validation + reads issued) and total (Future resolved)
  DCP save, DCP async_save (blocking / total), DCP load (in place into preallocated tensors)
and prints a table of medians with ratios ours / DCP.

Single process:
  python bench/checkpoint.py --mb 504
Two ranks (params Shard(0) on a 1-d mesh, gloo):
  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/checkpoint.py --mb 504

The state is GPT-like: blocks of (d, 3d), (d, d), (d, 4d), (4d, d) float32 weights (d = 512, 12 MiB
per block) plus an embedding, filled with random normals (incompressible like trained weights).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from functrain import checkpoint as ckpt  # noqa: E402


def build_state(mb: float, mesh) -> dict:
    """A GPT-like params dict of about ``mb`` MiB (DTensors with Shard(0) when ``mesh`` is given)."""
    d = 512
    block = {"attn.qkv": (d, 3 * d), "attn.proj": (d, d), "mlp.fc": (d, 4 * d), "mlp.proj": (4 * d, d)}
    block_bytes = sum(a * b for a, b in block.values()) * 4
    shapes = {"wte": (8192 if mb >= 64 else 1024, d)}
    wte_bytes = shapes["wte"][0] * d * 4
    n_blocks = max(1, round((mb * 2**20 - wte_bytes) / block_bytes))
    for i in range(n_blocks):
        shapes.update({f"blocks.{i}.{k}": s for k, s in block.items()})
    g = torch.Generator().manual_seed(0)
    params = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            t = distribute_tensor(t, mesh, [Shard(0)])
        params[name] = t
    return {"params": params, "step": torch.tensor(0, dtype=torch.int64)}


def _sync():
    """Barrier across ranks (no-op on one process)."""
    if dist.is_initialized():
        dist.barrier()


def _max(x: float) -> float:
    """The slowest rank's time."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class Bench:
    """Runs the methods on fresh directories under ``root``; collects (blocking, total) seconds."""

    def __init__(self, root: str, state: dict, compression):
        self.root, self.state, self.compression = root, state, compression
        self.writer = ckpt.AsyncWriter(reuse_buffers=True)  # what Manager uses by default
        self.fresh_writer = ckpt.AsyncWriter(self.writer.group)  # new host buffers every save
        self.template = ckpt.abstract(state)
        self.dcp_target = {
            "params": {k: torch.zeros_like(v) for k, v in state["params"].items()},
            "step": torch.zeros_like(state["step"]),
        }
        self.n = 0
        self.ours_dir = self._fresh("ours_ref")
        self.writer.save(self.ours_dir, state, compression=compression).result()
        self.dcp_dir = self._fresh("dcp_ref")
        dcp.save(state, checkpoint_id=self.dcp_dir)

    def _fresh(self, tag: str) -> str:
        """A new, unused checkpoint path."""
        self.n += 1
        return os.path.join(self.root, f"{tag}_{self.n}")

    def _clean(self, path: str) -> None:
        """Removes a written checkpoint (rank 0), outside the timed region."""
        _sync()
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        _sync()

    def ours_async(self, writer=None):
        """Our async save: (blocking, total)."""
        path = self._fresh("ours_async")
        _sync()
        t0 = time.perf_counter()
        fut = (writer or self.writer).save(path, self.state, compression=self.compression)
        blocking = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        self._clean(path)
        return blocking, total

    def ours_async_fresh(self):
        """Our async save with new host buffers every time: (blocking, total)."""
        return self.ours_async(self.fresh_writer)

    def ours_sync(self):
        """Our save until committed: (total, total)."""
        path = self._fresh("ours_sync")
        _sync()
        t0 = time.perf_counter()
        self.writer.save(path, self.state, compression=self.compression).result()
        total = time.perf_counter() - t0
        self._clean(path)
        return total, total

    def ours_restore(self):
        """Our restore onto the same sharding: (until the Future is returned, until it resolved)."""
        _sync()
        t0 = time.perf_counter()
        fut = ckpt.restore(self.ours_dir, self.template)
        blocking = time.perf_counter() - t0
        out = fut.result()
        total = time.perf_counter() - t0
        assert out["params"]["wte"].shape == self.state["params"]["wte"].shape
        return blocking, total

    def dcp_save(self):
        """torch.distributed.checkpoint.save: (total, total)."""
        path = self._fresh("dcp_sync")
        _sync()
        t0 = time.perf_counter()
        dcp.save(self.state, checkpoint_id=path)
        total = time.perf_counter() - t0
        self._clean(path)
        return total, total

    def dcp_async(self):
        """torch.distributed.checkpoint.async_save: (blocking, total)."""
        path = self._fresh("dcp_async")
        _sync()
        t0 = time.perf_counter()
        fut = dcp.async_save(self.state, checkpoint_id=path)
        blocking = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        self._clean(path)
        return blocking, total

    def dcp_load(self):
        """torch.distributed.checkpoint.load in place: (total, total)."""
        _sync()
        t0 = time.perf_counter()
        dcp.load(self.dcp_target, checkpoint_id=self.dcp_dir)
        total = time.perf_counter() - t0
        return total, total


ROWS = [  # (label, ours method, DCP method to compare with, column compared)
    ("async save: blocking", "ours_async", "dcp_async", 0),
    ("  (fresh host buffers)", "ours_async_fresh", "dcp_async", 0),
    ("async save: total", "ours_async", "dcp_async", 1),
    ("sync save", "ours_sync", "dcp_save", 1),
    ("restore: blocking", "ours_restore", None, 0),
    ("restore: total", "ours_restore", "dcp_load", 1),
]


def main():
    """Parses flags, builds the state, runs the interleaved repetitions and prints the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=48, help="state size in MiB (default 48; the design used 504)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every method (medians reported)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temp dir, removed after)")
    p.add_argument("--compression", choices=["zstd", "none"], default="zstd", help="our compression")
    args = p.parse_args()

    mesh = None
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    root = args.dir
    if root is None and rank == 0:
        root = tempfile.mkdtemp(prefix="functrain_ckpt_bench_")
    if dist.is_initialized():  # every rank uses rank 0's directory
        box = [root]
        dist.broadcast_object_list(box, src=0)
        root = box[0]
    state = build_state(args.mb, mesh)
    nbytes = sum(v.numel() * v.element_size() for v in state["params"].values())
    bench = Bench(root, state, None if args.compression == "none" else "zstd")

    methods = ["ours_async", "ours_async_fresh", "ours_sync", "ours_restore", "dcp_save", "dcp_async", "dcp_load"]
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    for _ in range(args.reps):
        for m in methods:  # interleaved, so drift and cache effects hit every method alike
            b, t = getattr(bench, m)()
            times[m].append((_max(b), _max(t)))

    bench.writer.close()
    bench.fresh_writer.close()
    if rank == 0:
        med = {m: tuple(statistics.median(x[i] for x in times[m]) for i in range(2)) for m in methods}
        print(
            f"\ncheckpoint bench: {nbytes / 2**20:.0f} MiB float32, {world} process(es)"
            f"{' (params Shard(0), gloo)' if world > 1 else ''}, ours compression={args.compression}, "
            f"torch {torch.__version__}, {os.cpu_count()} CPU cores, median of {args.reps}"
        )
        print(f"{'':24s}{'functrain (s)':>14s}{'DCP (s)':>10s}{'ours/DCP':>10s}")
        for label, ours, theirs, col in ROWS:
            o = med[ours][col]
            if theirs is None:
                print(f"{label:24s}{o:14.3f}{'-':>10s}{'-':>10s}")
            else:
                d = med[theirs][col]
                print(f"{label:24s}{o:14.3f}{d:10.3f}{o / d:10.2f}")
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
