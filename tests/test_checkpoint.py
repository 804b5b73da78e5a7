"""Single-process checkpoint tests: round trips, on-disk layout, sharding arithmetic, Manager
(retention, crash leftovers, validation errors) and async save semantics."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time

import optree
import pytest
import torch
from _ckpt_util import PYTHON, REPO, assert_bits_equal, full_state
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from functrain import checkpoint as ckpt
from functrain.checkpoint import orbax_format, writer
from functrain.checkpoint.sharding import chunk_shape, shard_box, writer_ranks


def _zarray(path: str, name: str) -> dict:
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/default/"}).result()
    return json.loads(kv.read(f"{name}/.zarray".encode()).result().value)


# ------------------------------------------------------------------------------------------------
# Round trips and layout


def test_roundtrip_mixed_tree_bit_exact(tmp_path):
    state = full_state()
    path = str(tmp_path / "7")
    ckpt.save(path, state)
    fut = ckpt.restore(path, ckpt.abstract(state))
    out = fut.result()
    assert type(out) is type(state) and type(out.opt_state[0]) is type(state.opt_state[0])
    assert list(out.params) == list(state.params)  # dict key order kept (compiled steps guard on it)
    assert_bits_equal(out, state, "abstract template")
    meta = optree.tree_map(lambda t: torch.empty_like(t, device="meta"), state)
    assert_bits_equal(ckpt.restore(path, meta).result(), state, "meta template")
    # No template: nested dicts, sequences as lists, NamedTuple fields by name.
    plain = ckpt.restore(path).result()
    assert plain["opt_state"][0]["count"].item() == 3
    assert isinstance(plain["opt_state"][1]["hist"], list)
    assert_bits_equal(plain["params"], state.params, "no template")


def test_every_supported_dtype_roundtrips(tmp_path):
    from functrain.checkpoint.tsspec import TORCH_DTYPES

    state = {name: torch.arange(-3, 3, dtype=torch.float32).reshape(2, 3).to(dt) for name, dt in TORCH_DTYPES.items()}
    state["empty"] = torch.empty(0, 3)
    ckpt.save(str(tmp_path / "1"), state)
    assert_bits_equal(ckpt.restore(str(tmp_path / "1"), ckpt.abstract(state)).result(), state)
    with pytest.raises(TypeError, match="leaf 'q': torch.sparse_coo"):
        ckpt.save(str(tmp_path / "2"), {"q": torch.ones(2).to_sparse()})
    with pytest.raises(TypeError, match="leaf 'q': dtype torch.bits8 cannot be stored"):
        ckpt.save(str(tmp_path / "3"), {"q": torch.empty(2, dtype=torch.bits8)})


def test_layout_is_orbax_v0(tmp_path):
    path = str(tmp_path / "7")
    ckpt.save(path, full_state())
    assert sorted(os.listdir(path)) == ["_CHECKPOINT_METADATA", "commit_success.txt", "default"]
    assert sorted(os.listdir(os.path.join(path, "default"))) == ["_METADATA", "d", "manifest.ocdbt", "ocdbt.process_0"]
    assert not os.path.exists(path + orbax_format.TMP_SUFFIX)
    cm = json.load(open(os.path.join(path, "_CHECKPOINT_METADATA")))
    assert cm["item_handlers"] == {"default": orbax_format.STANDARD_HANDLER}
    assert cm["init_timestamp_nsecs"] <= cm["commit_timestamp_nsecs"]
    meta = json.load(open(os.path.join(path, "default", "_METADATA")))
    assert meta["use_ocdbt"] is True and meta["use_zarr3"] is False
    tm = meta["tree_metadata"]
    assert tm["('params', 'wte.weight')"]["key_metadata"] == [
        {"key": "params", "key_type": 2},
        {"key": "wte.weight", "key_type": 2},
    ]
    # NamedTuple fields and dict keys are key_type 2, tuple/list indices key_type 1 (as orbax writes).
    assert [k["key_type"] for k in tm["('opt_state', '0', 'mu', 'head.weight')"]["key_metadata"]] == [2, 1, 2, 2]
    assert [k["key_type"] for k in tm["('opt_state', '1', 'hist', '0')"]["key_metadata"]] == [2, 1, 2, 1]
    assert tm["('step',)"]["value_metadata"] == {"value_type": "np.ndarray", "skip_deserialize": False}
    assert len(tm) == len(optree.tree_leaves(full_state()))
    z = _zarray(path, "params.wte.weight")
    assert z["dtype"] == "bfloat16" and z["shape"] == [7, 4] and z["chunks"] == [7, 4]
    assert z["compressor"] == {"id": "zstd", "level": 1} and z["zarr_format"] == 2
    assert _zarray(path, "rng")["dtype"] == "<i8"


def test_uncompressed(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, full_state(), compression=None)
    assert _zarray(path, "params.wte.weight")["compressor"] is None
    assert_bits_equal(ckpt.restore(path, ckpt.abstract(full_state())).result(), full_state())
    with pytest.raises(ValueError, match="compression"):
        ckpt.save(str(tmp_path / "2"), full_state(), compression="lz4")


def test_read_metadata_and_cast(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, full_state())
    info = ckpt.read_metadata(path)
    assert info["params.wte.weight"].shape == (7, 4) and info["params.wte.weight"].dtype == torch.bfloat16
    assert info["step"].shape == () and info["step"].dtype == torch.int64
    t = {"params": {"wte.weight": ckpt.ArraySpec((7, 4), torch.float32)}}
    with pytest.raises(ckpt.CheckpointError, match="dtype bfloat16 but the template expects float32"):
        ckpt.restore(path, t)
    out = ckpt.restore(path, t, allow_cast=True).result()
    want = full_state().params["wte.weight"].float()
    assert out["params"]["wte.weight"].dtype == torch.float32
    assert torch.equal(out["params"]["wte.weight"].nan_to_num(), want.nan_to_num())


def test_bad_leaves_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="leaf 'params.lr'"):
        ckpt.save(str(tmp_path / "1"), {"params": {"lr": 0.1}})
    with pytest.raises(ValueError, match="meta device"):
        ckpt.save(str(tmp_path / "2"), {"w": torch.empty(2, device="meta")})
    with pytest.raises(ValueError, match="both join"):
        ckpt.save(str(tmp_path / "3"), {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})


@pytest.mark.slow
def test_no_jax_at_runtime():
    import ast
    import sys

    pkg = os.path.dirname(ckpt.__file__)
    for name in os.listdir(pkg):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(pkg, name)).read())
            for node in ast.walk(tree):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    mods = [node.module]
                assert not any(m.split(".")[0] in ("jax", "orbax") for m in mods), (name, mods)
    # Nothing functrain's checkpoint path imports brings jax or orbax in (checked in a fresh interpreter:
    # other tests in this process, the optax comparisons among them, load jax themselves).
    probe = (
        "import sys, functrain.checkpoint as c; from functrain.checkpoint import manager, reader, writer; "
        "print([m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'orbax.checkpoint'))])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


# ------------------------------------------------------------------------------------------------
# Sharding arithmetic (every rank computes every shard; must match torch's DTensor)

_MESHES = [(2,), (3,), (2, 2), (2, 3)]


@pytest.mark.parametrize("mesh_shape", _MESHES)
@pytest.mark.parametrize("global_shape", [(7, 5), (9, 4), (1, 3), (0, 2), (6, 6)])
def test_shard_box_matches_torch(mesh_shape, global_shape):
    choices = [Replicate(), Shard(0), Shard(1)]
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        boxes = []
        for coord in itertools.product(*(range(s) for s in mesh_shape)):
            box = shard_box(global_shape, mesh_shape, coord, placements)
            shape, offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coord), placements)
            assert box.shape == tuple(shape), (placements, coord)
            if not box.empty:
                assert box.offset == tuple(offset), (placements, coord)
            boxes.append(box)
        chunks = chunk_shape(global_shape, boxes)
        for box in boxes:  # every box is a union of whole chunks: no chunk has two writers
            for o, s, c, n in zip(box.offset, box.shape, chunks, global_shape):
                assert box.empty or (o % c == 0 and ((o + s) % c == 0 or o + s == n)), (placements, box, chunks)
        owners = writer_ranks(dict(enumerate(boxes)))
        assert sorted(owners.values()) == sorted(set(owners.values()))  # one writer per distinct box


def test_chunk_shape_is_ceil_sized_local_shard():
    boxes = [shard_box((7, 3), (2,), (r,), [Shard(0)]) for r in range(2)]
    assert chunk_shape((7, 3), boxes) == (4, 3)


# ------------------------------------------------------------------------------------------------
# Manager


def test_manager_retention_latest_should_save(tmp_path):
    with ckpt.Manager(tmp_path, keep=2, every=2, keep_every=4) as mgr:
        assert mgr.latest_step() is None and mgr.all_steps() == []
        for step in range(1, 11):
            saved = mgr.save(step, {"w": torch.full((3,), float(step))})
            assert saved == (step % 2 == 0)
        mgr.wait()
        assert mgr.all_steps() == [4, 8, 10] and mgr.latest_step() == 10  # last 2 + every 4th
        assert sorted(os.listdir(tmp_path)) == ["10", "4", "8"]
        assert not mgr.should_save(10) and mgr.should_save(12) and not mgr.should_save(11)
        assert mgr.save(11, {"w": torch.zeros(3)}, force=True)
        with pytest.raises(ckpt.CheckpointError, match="already exists"):
            mgr.save(11, {"w": torch.zeros(3)}, force=True)
        assert mgr.all_steps() == [4, 8, 10, 11]
        assert mgr.restore(template={"w": torch.empty(3)}).result()["w"].tolist() == [0.0] * 3
        assert mgr.restore(8, {"w": torch.empty(3)}).result()["w"].tolist() == [8.0] * 3
    assert ckpt.Manager(tmp_path, keep=None).all_steps() == [4, 8, 10, 11]


def test_manager_ignores_and_cleans_tmp_dirs(tmp_path):
    ckpt.save(str(tmp_path / "5"), {"w": torch.ones(2)})
    (tmp_path / "9.orbax-checkpoint-tmp" / "default").mkdir(parents=True)
    (tmp_path / "3.orbax-checkpoint-tmp-deleting").mkdir()
    (tmp_path / "notes").mkdir()
    mgr = ckpt.Manager(tmp_path)
    assert mgr.all_steps() == [5]
    assert sorted(os.listdir(tmp_path)) == ["5", "notes"]
    mgr.close()


_CRASH = r"""
import sys, time, torch
from functrain import checkpoint as ckpt
from functrain.checkpoint import writer
mgr = ckpt.Manager(sys.argv[1])
mgr.save(1, {"w": torch.arange(1000.0)}); mgr.wait()
def stuck(*args, **kwargs):
    print("committing", flush=True)
    time.sleep(120)
writer._merge_and_commit = stuck
mgr.save(2, {"w": torch.arange(1000.0) + 1})
time.sleep(120)
"""


@pytest.mark.slow
def test_kill_during_save_keeps_previous_step(tmp_path):
    p = subprocess.Popen([PYTHON, "-c", _CRASH, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "committing"  # step 2's chunks are written, not committed
    finally:
        p.kill()  # SIGKILL
        p.wait()
    assert sorted(os.listdir(tmp_path)) == ["1", "2.orbax-checkpoint-tmp"]
    mgr = ckpt.Manager(tmp_path)
    assert mgr.all_steps() == [1] and os.listdir(tmp_path) == ["1"]
    assert mgr.restore(template={"w": torch.empty(1000)}).result()["w"][-1].item() == 999.0
    assert mgr.save(2, {"w": torch.ones(1000)})
    mgr.close()
    assert mgr.all_steps() == [1, 2]


_RESTORE_AND_EXIT = r"""
import sys
from functrain import checkpoint as ckpt
tree = ckpt.restore(sys.argv[1]).result()
assert float(tree["w1499"][0]) == 1499.0
"""


@pytest.mark.slow
def test_a_process_that_exits_right_after_a_restore_exits_cleanly(tmp_path):
    """The restore thread drops its TensorStore futures before resolving the future; before, a program
    that restored and exited aborted ("terminate called without an active exception") in 12 of 12
    runs with this many leaves."""
    ckpt.save(str(tmp_path / "1"), {f"w{i}": torch.full((3,), float(i)) for i in range(1500)})
    for _ in range(3):
        out = subprocess.run(
            [PYTHON, "-c", _RESTORE_AND_EXIT, str(tmp_path / "1")],
            cwd=REPO,
            timeout=300,
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert out.returncode == 0, out.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Validation: one clear CheckpointError line naming the checkpoint and the leaf


def _truncate_files(*parts):
    def truncate(path):
        d = os.path.join(path, *parts)
        for f in os.listdir(d):
            full = os.path.join(d, f)
            os.truncate(full, os.path.getsize(full) // 2)

    return truncate


_BREAKAGES = {
    "missing commit marker": (lambda p: os.remove(os.path.join(p, "commit_success.txt")), None, "commit_success.txt"),
    "missing _METADATA": (lambda p: os.remove(os.path.join(p, "default", "_METADATA")), None, "_METADATA is missing"),
    "corrupt _METADATA": (
        lambda p: open(os.path.join(p, "default", "_METADATA"), "w").write("{not json"),
        None,
        "cannot be parsed",
    ),
    "truncated chunk": (_truncate_files("default", "ocdbt.process_0", "d"), "params.w", "cannot be read"),
    "truncated root b-tree": (_truncate_files("default", "d"), "params.w", "cannot be opened"),
    "missing per-process db": (
        lambda p: shutil.rmtree(os.path.join(p, "default", "ocdbt.process_0")),
        "params.w",
        "cannot be read",
    ),
}


@pytest.mark.parametrize("breakage", list(_BREAKAGES))
def test_broken_checkpoint_gives_one_clear_error(tmp_path, breakage):
    mgr = ckpt.Manager(tmp_path)
    state = {"params": {"w": torch.randn(64, 64)}, "step": torch.tensor(10)}
    mgr.save(10, state)
    mgr.wait()
    path = str(tmp_path / "10")
    breaker, leaf, words = _BREAKAGES[breakage]
    breaker(path)
    with pytest.raises(ckpt.CheckpointError) as err:
        mgr.restore(10, ckpt.abstract(state)).result()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {path}:") and words in msg, msg
    if leaf:
        assert f"leaf {leaf!r}" in msg, msg
    mgr.close()


@pytest.mark.parametrize(
    "template, words",
    [
        (
            {"params": {"w": torch.empty(128, 64)}},
            "leaf 'params.w' has shape (64, 64) but the template expects (128, 64)",
        ),
        ({"params": {"w": torch.empty(64, 64, dtype=torch.bfloat16)}}, "leaf 'params.w' has dtype float32"),
        ({"params": {"b": torch.empty(3)}}, "leaf 'params.b' is missing"),
        ({"params": {}}, "leaf 'params.w' is in the checkpoint but not in this program's state"),  # strict
    ],
)
def test_template_mismatch_gives_one_clear_error(tmp_path, template, words):
    ckpt.save(str(tmp_path / "10"), {"params": {"w": torch.randn(64, 64)}})
    with pytest.raises(ckpt.MismatchError) as err:  # a CheckpointError that names the leaves
        ckpt.restore(str(tmp_path / "10"), template, strict=not template["params"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {tmp_path / '10'}:") and words in msg, msg
    assert isinstance(err.value, ckpt.CheckpointError) and err.value.leaves == (words.split("'")[1],)


def test_restore_without_checkpoints(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="no committed checkpoint"):
        ckpt.Manager(tmp_path).restore(template={"w": torch.empty(1)})


# ------------------------------------------------------------------------------------------------
# Async save


@pytest.fixture
def slow_writes(monkeypatch):
    """Makes every background write take at least 0.4 s longer."""
    original = writer._write_process_db

    def slow(*args, **kwargs):
        time.sleep(0.4)
        return original(*args, **kwargs)

    monkeypatch.setattr(writer, "_write_process_db", slow)


def test_async_save_blocks_only_for_the_snapshot(tmp_path):
    state = {"w": torch.randn(4096, 2048)}  # 32 MiB
    with ckpt.Manager(tmp_path) as mgr:
        t0 = time.perf_counter()
        mgr.save(1, state)
        blocking = time.perf_counter() - t0
        mgr.wait()
        total = time.perf_counter() - t0
    assert blocking < total / 2, (blocking, total)


def test_second_save_waits_for_the_first(tmp_path, slow_writes):
    with ckpt.Manager(tmp_path) as mgr:
        t0 = time.perf_counter()
        mgr.save(1, {"w": torch.ones(4)})
        assert time.perf_counter() - t0 < 0.3 and mgr.all_steps() == []
        mgr.save(2, {"w": torch.ones(4)})
        assert time.perf_counter() - t0 >= 0.4 and mgr.all_steps() == [1]
    assert mgr.all_steps() == [1, 2]


def test_mutating_state_after_save_returns(tmp_path, slow_writes):
    state = full_state()
    fut = ckpt.save_async(str(tmp_path / "1"), state)
    for leaf in optree.tree_leaves(state):
        leaf.zero_()
    assert not fut.done()
    fut.result()
    assert_bits_equal(ckpt.restore(str(tmp_path / "1"), ckpt.abstract(full_state())).result(), full_state())


def test_background_failure_surfaces_on_wait(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "_write_process_db", broken)
    mgr = ckpt.Manager(tmp_path)
    mgr.save(1, {"w": torch.ones(2)})
    want = r"checkpoint .*/1: save failed while writing chunks \(OSError: disk full\)"
    with pytest.raises(ckpt.CheckpointError, match=want):
        mgr.wait()
    mgr.wait()  # raised once
    assert mgr.all_steps() == [] and mgr.should_save(1)
    monkeypatch.undo()
    mgr.close()
    assert ckpt.Manager(tmp_path).all_steps() == [] and os.listdir(tmp_path) == []


def test_reused_snapshot_buffers_keep_every_save_intact(tmp_path, slow_writes):
    with ckpt.Manager(tmp_path, keep=None, reuse_buffers=True) as mgr:
        state = {"w": torch.zeros(64, 8)}
        ptrs = set()
        for step in (1, 2, 3):
            state["w"].fill_(step)
            mgr.save(step, state)
            ptrs.add(mgr._writer._buffers["w"].data_ptr())
            state["w"].fill_(-1.0)  # mutation right after save() returns
        assert len(ptrs) == 1  # one host buffer, reused by every snapshot
        mgr.wait()
        for step in (1, 2, 3):
            out = mgr.restore(step, {"w": torch.empty(64, 8)}).result()
            assert torch.equal(out["w"], torch.full((64, 8), float(step)))


def test_skipped_steps_do_not_wait_for_a_save_in_flight(tmp_path, slow_writes):
    with ckpt.Manager(tmp_path, every=2) as mgr:
        assert mgr.save(2, {"w": torch.ones(4)})
        t0 = time.perf_counter()
        assert not mgr.save(3, {"w": torch.ones(4)}) and not mgr.save(2, {"w": torch.ones(4)})
        assert time.perf_counter() - t0 < 0.2 and mgr.all_steps() == []
    assert mgr.all_steps() == [2]


# ------------------------------------------------------------------------------------------------
# Empty subtrees, and checkpoints that outlive the code


def test_empty_subtrees_are_recorded_as_orbax_does(tmp_path):
    """`()`, `[]`, `{}` and None get orbax's empty-value entries; a template-free restore has them."""
    tree = {"opt": ((), ({"w": torch.ones(2)}, [], {}), None), "step": torch.tensor(3)}
    path = str(tmp_path / "1")
    ckpt.save(path, tree)
    tm = json.load(open(os.path.join(path, "default", "_METADATA")))["tree_metadata"]
    empty = {k: v["value_metadata"] for k, v in tm.items() if v["value_metadata"]["skip_deserialize"]}
    assert empty == {
        "('opt', '0')": {"value_type": "Tuple", "skip_deserialize": True},
        "('opt', '1', '1')": {"value_type": "List", "skip_deserialize": True},
        "('opt', '1', '2')": {"value_type": "Dict", "skip_deserialize": True},
        "('opt', '2')": {"value_type": "None", "skip_deserialize": True},
    }
    out = ckpt.restore(path).result()
    assert out["opt"][0] == () and out["opt"][1][1] == [] and out["opt"][1][2] == {} and out["opt"][2] is None
    assert torch.equal(out["opt"][1][0]["w"], torch.ones(2)) and int(out["step"]) == 3


def test_a_checkpoint_that_lacks_a_leaf_of_the_template_is_one_line(tmp_path):
    """A template leaf absent from the checkpoint is a MismatchError naming it; a checkpoint leaf absent from the
    template is refused with strict=True and ignored without."""
    from functrain import init_state, optim

    opt = optim.adamw(1e-3)
    old = init_state({"w": torch.arange(6.0).reshape(2, 3)}, opt, seed=1)
    written = {k: v for k, v in old._asdict().items() if k != "guard"}
    with ckpt.Manager(str(tmp_path / "ck")) as mgr:
        mgr.save(5, written)
        fresh = init_state({"w": torch.zeros(2, 3)}, opt, seed=1)
        with pytest.raises(ckpt.MismatchError, match="leaf 'guard.skipped' is missing") as err:
            mgr.restore(5, ckpt.abstract(fresh))
        assert "\n" not in str(err.value) and err.value.leaves[0] == "guard.skipped"
        mgr.save(6, {**old._asdict(), "extra": {"ema": torch.ones(3)}})
        with pytest.raises(ckpt.CheckpointError, match="leaf 'extra.ema' is in the checkpoint but not"):
            mgr.restore(6, ckpt.abstract(fresh), strict=True)
        assert torch.equal(mgr.restore(6, ckpt.abstract(fresh)).result().params["w"], old.params["w"])  # lenient
