"""One gloo rank running the multi-process checkpoint scenarios (launched by test_checkpoint_dist.py).

Usage: python tests/_ckpt_worker.py <workdir> [scenario ...]
Each scenario's outcome ("ok" or the traceback) goes to <workdir>/results_rank<r>.json so that one
failing scenario does not hide the others.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import optree
import tensorstore as ts
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ckpt_util import assert_bits_equal, full_state  # noqa: E402

from functrain import checkpoint as ckpt  # noqa: E402


def s0(t):
    return [Shard(0)]


def s1(t):
    return [Shard(1)] if t.ndim > 1 else [Shard(0)]


def rep(t):
    return [Replicate()]


def _map_sharded(state, fn):
    """Applies ``fn(tensor)`` to params, mu and nu (the sharded leaves); the rest stays as is."""
    adam, extra = state.opt_state
    adam = adam._replace(mu={k: fn(v) for k, v in adam.mu.items()}, nu={k: fn(v) for k, v in adam.nu.items()})
    return state._replace(params={k: fn(v) for k, v in state.params.items()}, opt_state=(adam, extra))


def distribute(state, mesh, place, place_nu=None):
    """DTensor version of a full state: params/mu with ``place``, nu with ``place_nu`` (default same)."""
    out = _map_sharded(state, lambda t: distribute_tensor(t, mesh, place(t)))
    if place_nu is not None:
        adam, extra = out.opt_state
        nu = {k: distribute_tensor(v, mesh, place_nu(v)) for k, v in state.opt_state[0].nu.items()}
        out = out._replace(opt_state=(adam._replace(nu=nu), extra))
    return out


def spec_template(state, mesh, place):
    """ArraySpec template: sharded leaves on ``mesh`` with ``place``, the rest plain."""
    plain = optree.tree_map(ckpt.ArraySpec.like, state)
    return _map_sharded(
        plain, lambda s: ckpt.ArraySpec(s.shape, s.dtype, mesh, tuple(place(torch.empty(s.shape, device="meta"))))
    )


def meta_template(state):
    """Template whose DTensors have meta local tensors and whose plain tensors are meta."""

    def to_meta(x):
        if isinstance(x, DTensor):
            local = torch.empty(x.to_local().shape, dtype=x.dtype, device="meta")
            return DTensor.from_local(
                local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
            )
        return torch.empty(x.shape, dtype=x.dtype, device="meta")

    return optree.tree_map(to_meta, state)


def assert_same_shards(a, b):
    """Same placements and bit-identical local shards, leaf by leaf."""
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert type(x) is type(y), (type(x), type(y))
        if isinstance(x, DTensor):
            assert x.placements == y.placements and x.device_mesh == y.device_mesh
            assert_bits_equal(x.to_local(), y.to_local(), "local shard")
    assert_bits_equal(a, b, "full")


def db_keys(path, process):
    """Keys stored in the per-process OCDBT database of ``process`` (empty if it does not exist)."""
    d = os.path.join(path, "default", f"ocdbt.process_{process}")
    if not os.path.exists(d):
        return []
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{d}/"}).result()
    return [k.decode() for k in kv.list().result()]


def sc_roundtrip(wd, mesh):
    """Mixed Shard(0)/Replicate state, uneven rows; async save while collectives run on the default group."""
    st = distribute(full_state(), mesh, s0, place_nu=rep)
    with ckpt.Manager(os.path.join(wd, "rt"), keep=2) as m:
        assert m.save(1, st)
        for _ in range(20):  # training-step collectives while the save is in flight
            x = torch.ones(1000)
            dist.all_reduce(x)
            assert x[0].item() == dist.get_world_size()
        m.wait()
        assert m.all_steps() == [1]
        assert_same_shards(m.restore(1, ckpt.abstract(st)).result(), st)
        assert_same_shards(m.restore(1, meta_template(st)).result(), st)
        info = m.metadata(1)
        assert info["params.wte.weight"].chunks == (4, 4), info["params.wte.weight"]
        assert info["opt_state.0.nu.wte.weight"].chunks == (7, 4)
    keys1 = db_keys(os.path.join(wd, "rt", "1"), 1)
    # Rank 1 writes only its Shard(0) chunks: no metadata, no replicated leaves, no plain tensors.
    assert keys1 and all(k.endswith(("/1.0", "/1")) for k in keys1), keys1
    assert all(k.startswith(("params.", "opt_state.0.mu.")) for k in keys1), keys1


def sc_retention(wd, mesh):
    """keep=2 on 2 ranks: every rank agrees on the steps, rank 0 deletes the old ones."""
    st = distribute(full_state(), mesh, s0)
    with ckpt.Manager(os.path.join(wd, "ret"), keep=2) as m:
        for step in (1, 2, 3):
            assert m.save(step, st)
        m.wait()
        assert m.all_steps() == [2, 3] and m.latest_step() == 3
    dist.barrier()
    assert sorted(os.listdir(os.path.join(wd, "ret"))) == ["2", "3"]


def sc_reshard_s1(wd, mesh):
    """Written with Shard(0) (and Replicate) on 2 ranks -> restored as Shard(1) (dp -> tp)."""
    full = full_state()
    out = ckpt.restore(os.path.join(wd, "rt", "1"), spec_template(full, mesh, s1)).result()
    w = out.params["blocks.0.attn.qkv.weight"]
    assert w.placements == (Shard(1),) and tuple(w.to_local().shape) == (6, 3 - dist.get_rank())
    assert_bits_equal(out, full, "reshard")


def sc_replicate_to_s0(wd, mesh):
    """Replicated leaves are written once (rank 0) and restore as Shard(0)."""
    st = distribute(full_state(), mesh, rep)
    path = os.path.join(wd, "rep", "1")
    ckpt.save(path, st)
    assert db_keys(path, 1) == []
    out = ckpt.restore(path, spec_template(full_state(), mesh, s0)).result()
    assert out.params["wte.weight"].to_local().shape[0] == (4 if dist.get_rank() == 0 else 3)
    assert_bits_equal(out, full_state(), "rep->s0")


def sc_from_single(wd, mesh):
    """A single-process checkpoint (written by the test process) restores onto Shard(0) and Shard(1)."""
    path = os.path.join(wd, "single", "3")
    for place in (s0, s1):
        assert_bits_equal(ckpt.restore(path, spec_template(full_state(), mesh, place)).result(), full_state(), "1->2")


def sc_mesh2d(wd, mesh):
    """2-d meshes: (2, 1) with [Shard(0), Shard(1)] -> (1, 2) with [Replicate, Shard(0)]."""
    m21 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    m12 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    st = distribute(full_state(), m21, lambda t: [Shard(0), Shard(1) if t.ndim > 1 else Replicate()])
    path = os.path.join(wd, "m2d", "1")
    ckpt.save(path, st)
    assert_same_shards(ckpt.restore(path, ckpt.abstract(st)).result(), st)
    out = ckpt.restore(path, spec_template(full_state(), m12, lambda t: [Replicate(), Shard(0)])).result()
    assert out.params["wte.weight"].placements == (Replicate(), Shard(0))
    assert_bits_equal(out, full_state(), "2d")


def sc_mutate_after_save(wd, mesh):
    """Mutating the DTensor shards right after save_async returns does not change what is written."""
    st = distribute(full_state(), mesh, s0)
    fut = ckpt.save_async(os.path.join(wd, "mut", "1"), st)
    for v in st.params.values():
        v.to_local().fill_(0)
    fut.result()
    out = ckpt.restore(os.path.join(wd, "mut", "1"), spec_template(full_state(), mesh, s0)).result()
    assert_bits_equal(out, full_state(), "mutated after save")


SCENARIOS = {name[3:]: fn for name, fn in globals().items() if name.startswith("sc_")}


def main():
    wd, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name in names:
        try:
            SCENARIOS[name](wd, mesh)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(wd, f"results_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
