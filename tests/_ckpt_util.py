"""Shared helpers for the checkpoint tests: a deterministic mixed train state, bit-exact comparison
and running the stock-orbax side in its own process (2-rank launches use tests/_dist_launch.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from typing import NamedTuple

import optree
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


class AdamState(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict


class TrainState(NamedTuple):
    params: dict
    opt_state: tuple
    step: torch.Tensor
    rng: torch.Tensor


# name -> (shape, dtype); 7 rows split 4 + 3 on 2 ranks; 5 columns split 3 + 2.
PARAMS = {
    "wte.weight": ((7, 4), torch.bfloat16),
    "blocks.0.attn.qkv.weight": ((6, 5), torch.float32),
    "blocks.0.ln.bias": ((4,), torch.float16),
    "head.weight": ((5, 3), torch.bfloat16),
}


def tensor_for(name: str, shape, dtype) -> torch.Tensor:
    """A deterministic tensor for ``name`` (same on every process), with nan/-0/inf in floats."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if t.numel() >= 3:
            t.view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("inf")])
        return t.to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64).to(dtype)


def full_state() -> TrainState:
    """A mixed train state of plain tensors: NamedTuples, nested dicts, a tuple and a list."""
    params = {k: tensor_for(k, s, d) for k, (s, d) in PARAMS.items()}
    adam = AdamState(
        count=torch.tensor(3, dtype=torch.int64),
        mu={k: tensor_for("mu." + k, s, d) for k, (s, d) in PARAMS.items()},
        nu={k: tensor_for("nu." + k, s, d) for k, (s, d) in PARAMS.items()},
    )
    extra = {
        "ema": {"decay": tensor_for("ema.decay", (), torch.float32)},
        "hist": [tensor_for("h0", (2, 2), torch.float64)],
    }
    return TrainState(
        params=params,
        opt_state=(adam, extra),
        step=torch.tensor(7, dtype=torch.int64),
        rng=torch.tensor([12345, 2**40 + 3], dtype=torch.int64),
    )


def assert_bits_equal(a, b, where: str = "") -> None:
    """Asserts two pytrees have the same structure, dtypes, shapes and bit-identical values."""
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb, f"{where}: structure {sa} != {sb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        if hasattr(x, "full_tensor"):
            x = x.full_tensor()
        if hasattr(y, "full_tensor"):
            y = y.full_tensor()
        assert x.dtype == y.dtype, f"{where} leaf {i}: dtype {x.dtype} != {y.dtype}"
        assert x.shape == y.shape, f"{where} leaf {i}: shape {x.shape} != {y.shape}"
        xb = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        yb = y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(xb, yb), f"{where} leaf {i}: values differ"


ORBAX_SCRIPT = os.path.join(REPO, "tests", "_ckpt_orbax.py")


def orbax_missing() -> str | None:
    """Why the orbax interop tests cannot run (None if orbax-checkpoint is installed)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("orbax.checkpoint") is not None and importlib.util.find_spec("jax") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "orbax-checkpoint (and jax) not installed: pip install 'functrain[dev]'"


def run_orbax(args: list[str], timeout: float = 180) -> None:
    """Runs tests/_ckpt_orbax.py (stock orbax + jax) in a separate process; asserts success."""
    env = dict(os.environ, OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    cmd = [PYTHON, ORBAX_SCRIPT, *args]
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0 and "orbax ok" in p.stdout, f"orbax script failed:\n{p.stdout}\n{p.stderr[-6000:]}"


def load_dump(out: str) -> dict[str, torch.Tensor]:
    """Arrays dumped by _ckpt_orbax.py, as torch tensors keyed by '.'-joined tree path."""
    import numpy as np

    with open(out + ".json") as f:
        meta = json.load(f)
    raw = np.load(out + ".npz")
    return {
        name: torch.from_numpy(raw[name].copy()).view(getattr(torch, dtype)).reshape(shape)
        for name, (dtype, shape) in meta.items()
    }


def leaves_by_name(tree) -> dict[str, torch.Tensor]:
    """Leaves of a pytree keyed by '.'-joined path (NamedTuple fields by name), as orbax names them."""
    from functrain.checkpoint import orbax_format

    keys, leaves, _ = orbax_format.flatten(tree)
    return {k.name: v for k, v in zip(keys, leaves)}
