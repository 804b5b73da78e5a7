"""What the recipes share: flags, a tiny GPT, the embedded corpus and its batches (not a recipe).

Every recipe takes `--steps`, `--batch`, `--compile` (torch.compile its steps; off by default:
compiling even a tiny GPT takes a minute on a CPU), `--cache-dir` (where the corpus is tokenized:
`$FUNCTRAIN_CACHE_DIR`, else `<tmp>/functrain-data`) and `--threads` (default 1: a model this
small runs fastest on one thread), plus its own flags.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from functrain import data
from functrain.models import gpt

BLOCK = 32  # tokens per example


def parse(**own):
    """Parses the common flags plus the recipe's own (`name=default`; a bool default is a switch)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=own.pop("steps", 40))
    p.add_argument("--batch", type=int, default=own.pop("batch", 16))
    p.add_argument("--compile", action="store_true", help="torch.compile the recipe's steps")
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("FUNCTRAIN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "functrain-data")),
    )
    p.add_argument("--threads", type=int, default=1, help="a tiny model runs fastest on one thread")
    for name, default in own.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(default), default=default)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    return args


def tiny_gpt(**overrides) -> gpt.GPT:
    """A storage-free (meta) template of a 2-layer, 64-wide byte-level GPT; weights live in states."""
    cfg = gpt.GPTConfig(**{**dict(vocab_size=256, block_size=BLOCK, n_layer=2, n_head=2, n_embd=64), **overrides})
    with torch.device("meta"):
        return gpt.GPT(cfg)


def corpus(args):
    """The embedded stdlib corpus, tokenized once into `args.cache_dir`."""
    return data.load_dataset("stdlib", data.Placement(args.cache_dir))


def batch(args, ds, step: int):
    """Training batch `step`: (x, y), each (args.batch, BLOCK)."""
    return data.get_batch(ds.train, data.Batching(args.batch, BLOCK), step)


def val_batches(ds, num_batches: int = 4) -> list:
    """Fixed held-out batches of 32 examples."""
    return list(data.eval_batches(ds.val, data.Batching(32, BLOCK, eval_batches=num_batches)))


def synthetic_images(n: int, batch_size: int, classes: int = 4, seed: int = 0) -> list:
    """`n` batches (x (B, 3, 8, 8), y (B,)) of noisy images whose class is a brightness pattern."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 3, 8, 8, generator=g)  # one per class
    out = []
    for _ in range(n):
        y = torch.randint(0, classes, (batch_size,), generator=g)
        out.append((patterns[y] + 2.0 * torch.randn(batch_size, 3, 8, 8, generator=g), y))
    return out
