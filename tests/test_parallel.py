"""Single-process tests of functrain.parallel: mesh config, sharding rules, batch split, TP no-op."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from functrain import parallel
from functrain.models import gpt


class FakeMesh:
    """Just the mesh attributes the rules read: axis names and sizes."""

    def __init__(self, **sizes):
        self.mesh_dim_names = tuple(sizes)
        self._sizes = list(sizes.values())

    def size(self, i=None):
        return self._sizes[i]


@pytest.mark.parametrize(
    "cfg, world, expected",
    [
        (None, 4, (1, 4, 1, 1)),
        ({"tp": 2}, 8, (1, 4, 1, 2)),
        ({"dp_replicate": 2, "dp_shard": -1, "tp": 1}, 6, (2, 3, 1, 1)),
        ({"dp_replicate": -1, "dp_shard": 1, "tp": 2}, 4, (2, 1, 1, 2)),
        ({"dp_replicate": 1, "dp_shard": 1, "tp": 1}, 1, (1, 1, 1, 1)),
        ({"cp": 2}, 8, (1, 4, 2, 1)),
        ({"dp_shard": 1, "cp": -1, "tp": 2}, 8, (1, 1, 4, 2)),
        ({"pp": 2, "tp": 2}, 8, (1, 2, 1, 2)),  # the mesh of one of 2 pipeline stages
        ({"pp": 4, "dp_shard": -1}, 4, (1, 1, 1, 1)),
    ],
)
def test_mesh_shape_resolves_minus_one(cfg, world, expected):
    got = parallel.mesh_shape(cfg, world)
    assert tuple(got[a] for a in parallel.AXES) == expected


class _Cfg:  # attribute-style config (ml_collections.ConfigDict behaves the same)
    dp_replicate, dp_shard, tp = 1, 3, 1


@pytest.mark.parametrize(
    "cfg, world, fragment",
    [
        ({"dp_replicate": 1, "dp_shard": 2, "tp": 2}, 2, "product 4 != world size 2"),
        (_Cfg(), 2, "product 3 != world size 2"),
        ({"dp_shard": -1, "tp": 3}, 4, "not divisible by 3"),
        ({"dp_shard": -1, "tp": -1}, 4, "at most one axis may be -1"),
        ({"tp": 0}, 4, "must be positive or -1"),
        ({"cp": 3}, 4, "not divisible by 3"),
        ({"pp": 3}, 8, "pp=3: pipeline ranks must be a positive divisor of the world size 8"),
        ({"pp": 0}, 8, "pp=0"),
        ({"pp": 2, "dp_shard": 1, "tp": 2}, 8, "(one of pp=2 pipeline stages): product 2 != world size 4"),
    ],
)
def test_mesh_shape_rejects_bad_config_with_one_line(cfg, world, fragment):
    with pytest.raises(ValueError) as err:
        parallel.mesh_shape(cfg, world)
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg and msg.startswith("mesh config ")


def _gpt_placements(mesh):
    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32))
    rules = parallel.default_rules(gpt.TP_RULES)
    return {n: parallel.placements_for(n, p.shape, mesh, rules) for n, p in model.named_parameters()}


def test_fsdp_rule_shards_dim0_and_size1_axes_replicate():
    pl = _gpt_placements(FakeMesh(dp_replicate=1, dp_shard=4, tp=1))
    assert all(p == (Replicate(), Shard(0), Replicate()) for p in pl.values())


def test_tp_rules_colwise_rowwise_and_fsdp_moves_off_the_tp_dim():
    pl = _gpt_placements(FakeMesh(dp_replicate=2, dp_shard=2, tp=2))
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    assert pl["blocks.0.attn.q.weight"] == (R, S1, S0)  # colwise; FSDP moves to dim 1
    assert pl["blocks.0.attn.q.bias"] == (R, R, S0)  # 1-D colwise: nothing left for FSDP
    assert pl["blocks.0.mlp.fc.weight"] == (R, S1, S0)
    assert pl["blocks.0.attn.proj.weight"] == (R, S0, S1)  # rowwise
    assert pl["blocks.0.mlp.proj.bias"] == (R, S0, R)  # rowwise bias replicated on tp
    assert pl["wte.weight"] == (R, S0, R)
    assert pl["blocks.0.ln_1.weight"] == (R, S0, R)


def test_fsdp_rule_shards_over_cp_too_and_moves_off_a_taken_dim():
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    alone = _gpt_placements(FakeMesh(dp_replicate=1, dp_shard=1, cp=4, tp=1))
    assert all(p == (R, R, S0, R) for p in alone.values())  # cp alone: FSDP over cp
    both = _gpt_placements(FakeMesh(dp_replicate=1, dp_shard=2, cp=2, tp=1))
    assert both["wte.weight"] == (R, S0, S1, R)  # dp_shard takes dim 0, cp the next
    assert both["blocks.0.ln_1.weight"] == (R, S0, R, R)  # 1-D: nothing left for cp
    with_tp = _gpt_placements(FakeMesh(dp_replicate=1, dp_shard=1, cp=2, tp=2))
    assert with_tp["blocks.0.attn.q.weight"] == (R, R, S1, S0)  # colwise on tp, cp on dim 1


def test_rules_are_ordered_data():
    mesh = FakeMesh(dp_shard=2, tp=2)
    rules = [(r"\.ln_", {"dp_shard": Replicate()}), (r".*", {"dp_shard": Shard(-1)}), (r"^wte", {"tp": "colwise"})]
    assert parallel.placements_for("blocks.0.ln_1.weight", (32,), mesh, rules) == (Replicate(), Replicate())
    assert parallel.placements_for("x.weight", (4, 6), mesh, rules) == (Shard(1), Replicate())
    assert parallel.placements_for("wte.weight", (64, 32), mesh, rules) == (Shard(1), Shard(0))
    assert parallel.placements_for("scalar", (), mesh, rules) == (Replicate(), Replicate())
    with pytest.raises(ValueError, match="tensor-parallel kind"):
        parallel.tp_rules([("x", "diagonal")])


def test_split_batch_matches_get_batch_rows():
    x = torch.arange(8 * 3).reshape(8, 3)
    parts = [parallel.split_batch({"x": x}, r, 4)["x"] for r in range(4)]
    assert torch.equal(torch.cat(parts), x) and parts[1].shape == (2, 3)
    with pytest.raises(ValueError, match="not divisible"):
        parallel.split_batch(x, 0, 3)


def test_single_process_helpers_without_process_group():
    assert parallel.rank() == 0 and parallel.world_size() == 1 and parallel.is_main_process()
    parallel.barrier()  # no-op
    model = torch.nn.Linear(2, 2)
    assert parallel.tensor_parallel(model, None, parallel.default_rules()) is model
    state = {"w": torch.ones(2)}
    assert parallel.shard_state(state, None) is state
    assert parallel.gather(state)["w"] is state["w"]


_CONFIGURE = """
import torch
from functrain import parallel
with parallel.setup({"dp_shard": -1}, mesh_on_single_process=True) as ctx:
    params = parallel.shard_params({"w": torch.ones(4, 2)}, ctx.mesh)
    default = parallel.layout_of(params)
    assert (default.reduce_scatter, default.bucket_numel) == ("auto", 1 << 62)
    parallel.configure(ctx.mesh, reduce_scatter="all_to_all", bucket_numel=1000)
    routed = parallel.layout_of(params)  # the params live on a sub-mesh of ctx.mesh: it has the options
    assert (routed.reduce_scatter, routed.bucket_numel) == ("all_to_all", 1000)
    later = parallel.shard_params({"v": torch.ones(2)}, ctx.mesh)  # sharded after: the same options
    assert parallel.layout_of(later).reduce_scatter == "all_to_all"
    parallel.configure(ctx.mesh)
    assert parallel.layout_of(params) is default  # back to the defaults: the same layout object
    try:
        parallel.configure(ctx.mesh, reduce_scatter="ring")
    except ValueError as exc:
        print(exc)
    assert parallel.layout_of(params) is default  # a refused option changes nothing
"""


def test_a_meshs_layout_options_are_set_by_configure_and_reused():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CONFIGURE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "reduce_scatter='ring': use one of 'auto', 'reduce_scatter', 'all_to_all', 'all_reduce'"
    )
