"""A transformers causal LM, built from a tiny config and fine-tuned by `make_train_step`, dropout from the key.

A GPT-2 with dropout 0.1 (embeddings, residuals and attention) on the embedded corpus's bytes. The
module is transformers' own, unchanged: `functrain.apply` runs it with the state's params, and every
dropout inside it (`nn.Dropout`, SDPA's `dropout_p`) draws from the step's key, not from torch's
global generator. Checks: the loss falls; two runs from one seed are bit-identical, whatever
torch's global seed; another seed draws other masks. Without transformers it says so in one line.

    python examples/hf_model.py [--steps 30] [--compile]
"""

import _common as common
import torch

import functrain as ft
from functrain import optim

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError:
    raise SystemExit("hf_model: transformers is not installed here; pip install transformers (or '.[hf]')") from None

args = common.parse(steps=30)
ds = common.corpus(args)
dims = dict(vocab_size=256, n_positions=common.BLOCK, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
cfg = GPT2Config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, **dims)
torch.manual_seed(0)
model = GPT2LMHeadModel(cfg)  # transformers' init; its params become the state's


def loss_fn(params, batch, key):  # the module's dropout draws from `key` (functrain.nn.randomness)
    x, y = batch
    logits = ft.apply(model, params, input_ids=x).logits  # (B, T, 256)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()), {}


def train(seed: int, global_seed: int) -> list:
    torch.manual_seed(global_seed)  # plays no part: every mask comes from the state's key
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-3, weight_decay=0.1))
    state, losses = ft.init_state(model, opt, seed=seed), []
    step = ft.make_train_step(loss_fn, opt, compile=args.compile)
    for i in range(args.steps):
        state, metrics = step(state, common.batch(args, ds, i))
        losses.append(float(metrics["loss"]))
    return losses


a, b, c = train(0, global_seed=1), train(0, global_seed=2), train(1, global_seed=1)
assert a == b, "one seed, two runs: not bit-identical"
assert a[0] != c[0] and a[-1] < a[0] - 1.0, (a, c)
print(
    f"hf_model: OK GPT-2 ({sum(p.numel() for p in model.parameters()):,} params) loss {a[0]:.3f} -> {a[-1]:.3f}, "
    f"dropout 0.1 from the key: two runs from seed 0 bit-identical, seed 1 differs"
)
