"""safetensors reader/writer (against the real `safetensors` package) and the Hugging Face GPT-2 mapping."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from _dist_launch import run_ranks

from functrain import apply, rng
from functrain.interop import SafetensorsError, load_safetensors, safetensors_metadata, save_safetensors
from functrain.models import gpt
from functrain.models.gpt.hf import export_hf_gpt2, hf_gpt2_config, import_hf_gpt2

pytestmark = pytest.mark.numeric


def _mixed() -> dict[str, torch.Tensor]:
    """Tensors of every common dtype, incl. 0-d, empty, non-contiguous, nan/-0/inf."""
    g = torch.Generator().manual_seed(0)
    f = torch.randn(5, 3, generator=g)
    f[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return {
        "wte.weight": f.to(torch.bfloat16),
        "blocks.0.w": f.t(),  # non-contiguous float32
        "half": f.to(torch.float16),
        "double": f.double()[:2],
        "count": torch.tensor(7, dtype=torch.int64),
        "ids": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def _assert_same(a: dict, b: dict):
    """Same keys, dtypes, shapes and bits."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def test_round_trip_all_dtypes_bit_exact(tmp_path):
    params = _mixed()
    path = save_safetensors(params, tmp_path / "m.safetensors", metadata={"step": "10", "format": "pt"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert header["wte.weight"]["dtype"] == "BF16" and header["wte.weight"]["shape"] == [5, 3]
    assert header["count"]["dtype"] == "I64" and header["count"]["shape"] == []
    _assert_same(load_safetensors(path), params)
    assert list(load_safetensors(path, template=params)) == list(params)  # a template restores the order
    assert safetensors_metadata(path) == {"step": "10", "format": "pt"}
    assert not (tmp_path / "m.safetensors.tmp").exists()


def test_safetensors_package_reads_ours(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    safe_open = pytest.importorskip("safetensors").safe_open
    params = _mixed()
    path = save_safetensors(params, tmp_path / "ours.safetensors", metadata={"step": "10"})
    theirs = st.load_file(str(path))
    assert set(theirs) == set(params)
    _assert_same({k: theirs[k] for k in params}, params)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"step": "10"}


def test_we_read_safetensors_package_output(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    params = {k: v.contiguous() for k, v in _mixed().items()}
    path = tmp_path / "theirs.safetensors"
    st.save_file(params, str(path), metadata={"format": "pt"})
    ours = load_safetensors(path)
    _assert_same({k: ours[k] for k in params}, params)
    assert safetensors_metadata(path) == {"format": "pt"}


def test_template_orders_casts_places_and_checks(tmp_path):
    params = {"b": torch.randn(3, 2), "a": torch.arange(4)}
    path = save_safetensors(params, tmp_path / "m.safetensors")
    template = {"a": torch.zeros(4, dtype=torch.int32), "b": torch.zeros(3, 2, dtype=torch.bfloat16)}
    out = load_safetensors(path, template=template)
    assert list(out) == ["a", "b"] and out["a"].dtype == torch.int32 and out["b"].dtype == torch.bfloat16
    assert torch.equal(out["b"], params["b"].bfloat16())
    with torch.device("meta"):
        meta = {"b": torch.empty(3, 2), "a": torch.empty(4, dtype=torch.int64)}
    assert load_safetensors(path, template=meta)["a"].device.type == "cpu"
    with pytest.raises(SafetensorsError, match="missing \\['c'\\]"):
        load_safetensors(path, template={**template, "c": torch.zeros(1)})
    with pytest.raises(SafetensorsError, match="unexpected \\['b'\\]"):
        load_safetensors(path, template={"a": torch.zeros(4)})
    with pytest.raises(SafetensorsError, match="shape"):
        load_safetensors(path, template={"a": torch.zeros(5), "b": torch.zeros(3, 2)})


def test_nested_tree_saved_by_dotted_paths_and_restored_into_structure(tmp_path):
    tree = {"params": {"w": torch.randn(2, 2)}, "opt": (torch.tensor(3), {"mu": torch.ones(2)})}
    path = save_safetensors(tree, tmp_path / "t.safetensors")
    assert set(load_safetensors(path)) == {"params.w", "opt.0", "opt.1.mu"}
    back = load_safetensors(path, template=tree)
    assert torch.equal(back["params"]["w"], tree["params"]["w"]) and back["opt"][0] == 3
    assert isinstance(back["opt"], tuple)


def test_corrupt_files_raise_clear_errors(tmp_path):
    path = save_safetensors({"w": torch.randn(4, 4)}, tmp_path / "m.safetensors")
    raw = path.read_bytes()
    (tmp_path / "short").write_bytes(raw[:-4])
    with pytest.raises(SafetensorsError, match="short: not a valid safetensors file"):
        load_safetensors(tmp_path / "short")
    (tmp_path / "garbage").write_bytes(b"\x05" + b"\x00" * 7 + b"nope!")
    with pytest.raises(SafetensorsError, match="garbage: not a valid safetensors file.*JSON"):
        load_safetensors(tmp_path / "garbage")
    with pytest.raises(SafetensorsError, match="absent: no such file"):
        load_safetensors(tmp_path / "absent")
    with pytest.raises(TypeError, match="str to str"):
        save_safetensors({"w": torch.ones(1)}, tmp_path / "x", metadata={"step": 3})


_DIST_WORKER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    from functrain.interop import save_safetensors, load_safetensors
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = {"w": torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3),  # uneven: 4 + 3 rows
            "e": torch.arange(10, dtype=torch.bfloat16), "step": torch.tensor(5)}
    params = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
              "e": distribute_tensor(full["e"], mesh, [Replicate()]), "step": full["step"]}
    path = sys.argv[1]
    save_safetensors(params, path)
    assert os.path.exists(path)
    flat = load_safetensors(path)
    assert all(torch.equal(flat[k], full[k]) for k in full)
    back = load_safetensors(path, template=params)
    assert back["w"].placements == (Shard(0),) and torch.equal(back["w"].to_local(), params["w"].to_local())
    assert back["w"].to_local().shape[0] == (4 if rank == 0 else 3)
    assert torch.equal(back["e"].full_tensor(), full["e"]) and torch.equal(back["step"], full["step"])
    dist.destroy_process_group()
    print("OK", rank)
    """
)


@pytest.mark.slow
def test_dtensor_params_two_ranks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_DIST_WORKER)
    outs = run_ranks(str(script), [str(tmp_path / "d.safetensors")], nprocs=2, timeout=240)
    for rank, out in enumerate(outs):
        assert f"OK {rank}" in out, out


def _gpt(bias: bool, seed: int = 0):
    """A meta template, its config and perturbed params (nonzero biases when bias=True)."""
    cfg = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=bias)
    with torch.device("meta"):
        template = gpt.GPT(cfg)
    g = torch.Generator().manual_seed(seed)
    init = gpt.init_params(template, rng.key(seed))
    params = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in init.items()}
    return template, cfg, params


@pytest.mark.parametrize("bias", [True, False])
def test_hf_gpt2_export_import_round_trip_exact(bias):
    _, cfg, params = _gpt(bias)
    sd = export_hf_gpt2(params, cfg)
    assert len(sd) == 2 + 12 * cfg.n_layer + 2
    assert sd["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)
    assert sd["transformer.h.0.mlp.c_fc.weight"].shape == (32, 128)
    assert sd["transformer.h.0.mlp.c_proj.weight"].shape == (128, 32)
    c = cfg.n_embd  # c_attn is [q | k | v] along its output (second) axis, transposed
    assert torch.equal(sd["transformer.h.1.attn.c_attn.weight"][:, c : 2 * c], params["blocks.1.attn.k.weight"].t())
    if not bias:
        assert all(not torch.count_nonzero(v) for k, v in sd.items() if k.endswith(".bias"))
    back = import_hf_gpt2(sd, cfg)
    _assert_same(back, params)


def test_hf_gpt2_import_accepts_gpt2model_names_and_checks():
    _, cfg, params = _gpt(True)
    sd = export_hf_gpt2(params, cfg)
    bare = {k.removeprefix("transformer."): v for k, v in sd.items()}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)  # causal-mask buffer of older transformers
    _assert_same(import_hf_gpt2(bare, cfg), params)
    with pytest.raises(ValueError, match="cfg.bias=False"):
        import_hf_gpt2(sd, gpt.GPTConfig(**{**cfg.__dict__, "bias": False}))
    with pytest.raises(ValueError, match="shape"):
        import_hf_gpt2(sd, gpt.GPTConfig(**{**cfg.__dict__, "vocab_size": 65}))
    with pytest.raises(ValueError, match="no 'h.2.ln_1.weight'"):
        import_hf_gpt2(sd, gpt.GPTConfig(**{**cfg.__dict__, "n_layer": 3}))
    with pytest.raises(ValueError, match="unexpected"):
        import_hf_gpt2({**sd, "transformer.h.0.extra": torch.ones(1)}, cfg)
    with pytest.raises(ValueError, match="lm_head"):
        import_hf_gpt2({**sd, "lm_head.weight": sd["transformer.wte.weight"] + 1}, cfg)


@pytest.mark.parametrize("bias", [True, False])
def test_transformers_gpt2_computes_our_logits_from_exported_files(tmp_path, bias):
    transformers = pytest.importorskip("transformers")
    template, cfg, params = _gpt(bias)
    out = tmp_path / "hf"
    save_safetensors(export_hf_gpt2(params, cfg), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_gpt2_config(cfg)))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(x).logits
    import _tol  # two implementations of the same forward: reductions over the width, per layer

    _tol.assert_close(theirs, apply(template, params, x), _tol.rtol(4 * cfg.n_embd * cfg.n_layer * x.shape[1]))
    _assert_same(import_hf_gpt2(hf.state_dict(), cfg), params)  # and back, with the tied lm_head
