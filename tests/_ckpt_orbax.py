"""Stock orbax side of the interop tests; runs in its own process so jax never loads in pytest's.

Usage:
  python tests/_ckpt_orbax.py --read ROOT STEP OUT [--read ...] [--write ROOT OUT] [--standard ITEM OUT]

--read:  restores checkpoint STEP under ROOT with ocp.CheckpointManager (no args: numpy arrays), also
         onto 2 (virtual) CPU devices with a NamedSharding and checks both agree, and dumps the
         arrays to OUT.npz/OUT.json (raw bytes + dtype + shape, keyed by '.'-joined tree path), and the
         step's custom_metadata to OUT.custom.json.
--standard: `ocp.StandardCheckpointer().restore(ITEM)` with no template (ITEM = <step>/default), dumps
         the arrays and the tree's empty nodes to OUT, then restores ITEM again onto 2 CPU devices with
         every matrix sharded by columns (dim 1; ours are written by rows) and checks it equals.
--write: saves a nested tree (dicts, tuple, list; np float32/bfloat16/float16/int32/int64/uint32 and
         a jax.Array sharded over 2 devices) with CheckpointManager + StandardSave at ROOT/3 (zarr2)
         and with PyTreeCheckpointHandler(use_zarr3=True) at ROOT_zarr3/3, and dumps it to OUT.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402


def _name(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(getattr(k, "name", k)))
    return ".".join(parts)


def dump(tree, out: str) -> None:
    """Writes every array leaf as raw bytes (bit-exact, bfloat16 included) plus dtype and shape."""
    arrays, meta = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.asarray(leaf)
        name = _name(path)
        arrays[name] = np.frombuffer(a.tobytes(), dtype=np.uint8)
        meta[name] = [a.dtype.name, list(a.shape)]
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as f:
        json.dump(meta, f)


def read(root: str, step: int, out: str) -> None:
    mngr = ocp.CheckpointManager(root)
    assert step in mngr.all_steps(), (step, mngr.all_steps())
    restored = mngr.restore(step)
    # The same checkpoint onto 2 devices, rows sharded where they split evenly.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))

    def abstract(a):
        even = a.ndim and a.shape[0] % 2 == 0
        spec = jax.sharding.PartitionSpec("x") if even else jax.sharding.PartitionSpec()
        dtype = {np.dtype(np.int64): np.int32, np.dtype(np.float64): np.float32}.get(a.dtype, a.dtype)  # x64 off
        return jax.ShapeDtypeStruct(a.shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    sharded = mngr.restore(step, args=ocp.args.StandardRestore(jax.tree_util.tree_map(abstract, restored)))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree_util.tree_leaves(sharded)):
        if a.dtype.itemsize == 8:  # 64-bit leaves come back 32-bit in jax with x64 off
            continue
        assert len(b.sharding.device_set) == 2, _name(path)
        assert np.asarray(b).tobytes() == a.tobytes(), f"sharded restore of {_name(path)} differs"
    custom = mngr.metadata(step).custom_metadata  # what functrain saved with the step (e.g. its data record)
    mngr.close()
    dump(restored, out)
    with open(out + ".custom.json", "w") as f:
        json.dump(custom, f)


def _empty_paths(tree) -> dict:
    """{'.'-joined path: type name} of the empty containers and Nones in a restored tree."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            if not node:
                out[".".join(prefix)] = "dict"
            for k, v in node.items():
                walk(v, prefix + [str(k)])
        elif isinstance(node, (list, tuple)):
            if not node:
                out[".".join(prefix)] = type(node).__name__
            for i, v in enumerate(node):
                walk(v, prefix + [str(i)])
        elif node is None:
            out[".".join(prefix)] = "None"

    walk(tree, [])
    return out


def standard(item: str, out: str) -> None:
    restored = ocp.StandardCheckpointer().restore(item)  # no template: the whole tree from _METADATA
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))

    def by_columns(a):
        cols = a.ndim >= 2 and a.shape[1] % 2 == 0
        spec = jax.sharding.PartitionSpec(None, "x") if cols else jax.sharding.PartitionSpec()
        dtype = {np.dtype(np.int64): np.int32, np.dtype(np.float64): np.float32}.get(a.dtype, a.dtype)  # x64 off
        return jax.ShapeDtypeStruct(a.shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    target = jax.tree_util.tree_map(by_columns, restored)
    sharded = ocp.StandardCheckpointer().restore(item, target)
    columns = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree_util.tree_leaves(sharded)):
        if a.ndim >= 2 and a.shape[1] % 2 == 0:
            assert b.sharding.spec == jax.sharding.PartitionSpec(None, "x"), _name(path)
            assert len(b.sharding.device_set) == 2, _name(path)
            columns += 1
        if a.dtype.itemsize == 8:  # 64-bit leaves come back 32-bit in jax with x64 off
            assert np.array_equal(np.asarray(b), a.astype(np.asarray(b).dtype)), _name(path)
            continue
        assert np.asarray(b).tobytes() == a.tobytes(), f"column-sharded restore of {_name(path)} differs"
    dump(restored, out)
    with open(out + ".empty.json", "w") as f:
        json.dump({"empty": _empty_paths(restored), "column_sharded": columns}, f)


def write(root: str, out: str) -> None:
    rng = np.random.default_rng(0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    embed = rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16)
    tree = {
        "params": {
            "dense": {
                "kernel": rng.standard_normal((6, 4)).astype(np.float32),
                "bias": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
            },
            "embed.weight": jax.device_put(embed, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))),
        },
        "opt": (
            {"mu": rng.standard_normal(3).astype(np.float16)},
            [np.arange(4, dtype=np.int32).reshape(2, 2), np.asarray(2**40 + 1, np.int64)],
        ),
        "step": np.asarray(5, np.int64),
        "key": np.asarray([7, 2**32 - 1], np.uint32),
    }
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(3, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(root + "_zarr3", item_handlers=ocp.PyTreeCheckpointHandler(use_zarr3=True)) as mngr:
        mngr.save(3, args=ocp.args.PyTreeSave(tree))
        mngr.wait_until_finished()
    dump(tree, out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--read", nargs=3, action="append", default=[], metavar=("ROOT", "STEP", "OUT"))
    p.add_argument("--write", nargs=2, metavar=("ROOT", "OUT"))
    p.add_argument("--standard", nargs=2, metavar=("ITEM", "OUT"))
    args = p.parse_args()
    for root, step, out in args.read:
        read(root, int(step), out)
    if args.standard:
        standard(*args.standard)
    if args.write:
        write(*args.write)
    print("orbax ok")


if __name__ == "__main__":
    main()
