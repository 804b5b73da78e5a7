"""One transformers model type from a tiny config, checked against transformers itself (tests/test_hf_sweep.py).

`outcome(directory)` builds the family's template and init, compares them with a model transformers
builds for real (every parameter's mean and standard deviation, every buffer exactly), trains a few
AdamW steps unstaged and staged, each against the plain PyTorch loop on transformers' own module with
the same init and batches, checks that the family's export, loaded back by transformers, gives the
logits of the params it holds, and that every layer equals the function it shares with the layers
alike, then generates through the KV cache against transformers' greedy `generate`. It returns the
training outcome, "trains" or "unstaged only: <the one line>" or "refused: <the one line>", and the
decoding one, "cached" or "recomputes: <the probe's one line>".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import transformers
from _tol import assert_close, rtol

import functrain as ft
from functrain import optim, rng
from functrain.generation import Generator
from functrain.models import hf
from functrain.models.hf.tiny import write_tiny

STEPS, B, T, V = 2, 2, 16, 64
SHAPE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    head_dim=8,
)
TOL = rtol(B * T * V * 32) * STEPS


def write(directory: Path, model_type: str, drop: tuple = (), **extra) -> Path:
    """A tiny `model_type` directory (SHAPE but the `drop` keys, then `extra`) with every dropout of its config at
    zero (the loop's masks are torch's)."""
    write_tiny(directory, model_type, **{**{k: v for k, v in SHAPE.items() if k not in drop}, **extra})
    path = directory / "config.json"
    values = json.loads(path.read_text())

    def undrop(d):
        for k, v in list(d.items()):
            if isinstance(v, dict):
                undrop(v)
            elif ("drop" in k or "pdrop" in k) and isinstance(v, float):
                d[k] = 0.0

    undrop(values)
    path.write_text(json.dumps(values))
    return directory


def real_model(directory):
    """transformers' own module of the directory, built and initialized by `from_config`."""
    config = hf.load_config(directory)
    config.use_cache = False
    torch.manual_seed(0)  # its init draws from the global generator: the same draw whatever ran before
    try:
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def check_init(template, params, real) -> None:
    """Each parameter's mean and std within 6 standard errors of the real init's; buffers equal; constants equal.

    The standard errors are scaled by the larger of the two sample stds: both estimate one std, and a small
    tensor's (a head_dim vector) can land far below it.
    """
    for name, want in real.named_parameters():
        got, want = params[name].double(), want.detach().double()
        n = want.numel()
        if n == 1 or float(want.std()) == 0.0:  # a constant (ones, zeros, a computed value)
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (name, got.flatten()[:4], want.flatten()[:4])
            continue
        sd = max(float(want.std()), float(got.std()))
        assert abs(float(got.mean() - want.mean())) <= 6 * sd * math.sqrt(2.0 / n) + 1e-7, (name, "mean")
        stds = float(got.std()), float(want.std())
        assert abs(stds[0] - stds[1]) <= 6 * sd * math.sqrt(2.0 / (n - 1)) + 1e-7, (name, stds)
    ours = dict(template.named_buffers())
    for name, want in real.named_buffers():
        assert torch.equal(ours[name].to(want.dtype), want), name


def batches(n, seed=0, shape=(B, T)):
    """`n` batches of random (ids, targets) of `shape` below V."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, shape, generator=g), torch.randint(0, V, shape, generator=g)) for _ in range(n)]


def optimizer():
    """AdamW (lr 1e-3, no decay) after clipping at 1, as the torch loop runs it."""
    return optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.0))


def torch_loop(real, params, data):
    """Losses of `real` (our params loaded) trained by the plain loop."""
    missing, unexpected = real.load_state_dict(params, strict=False)
    tied = {n for n, _ in real.named_parameters(remove_duplicate=False)} - {n for n, _ in real.named_parameters()}
    kept = tied | {n for n, _ in real.named_buffers()}  # (a tied head is the embedding; buffers are its own)
    assert not unexpected and set(missing) <= kept, (unexpected, missing)
    real.train()
    opt = torch.optim.AdamW(real.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(real(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(real.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def functrain_losses(template, params, data, **loss):
    step = ft.make_train_step(hf.make_loss_fn(template, **loss), optimizer(), compile=False)
    state = ft.init_state(params, optimizer())
    out = []
    for batch in data:
        state, m = step(state, batch)
        out.append(float(m["loss"]))
    return out


def one_line(exc: Exception) -> str:
    text = str(exc)
    assert "\n" not in text and text, text
    return text


def check_shared(template, params) -> None:
    """Every layer equals the one function it shares (stages as the family makes them: checked)."""
    st = hf.stages(template, share=hf.check_stages(template))
    x = batches(1)[0][0]
    with torch.no_grad():
        h = st.embed.fn(st.embed.params(params), x, None)
        for i, block in enumerate(st.blocks):
            out = block.fn(block.params(params), h, None)
            if block.shared is not None:
                alone = block.shared(block.own(params), h, None, torch.tensor(i))
                assert_close(alone, out, rtol(T * 64)), f"layer {i}"
            h = out


def check_export(directory, template, params) -> None:
    """The family's export, loaded back by transformers, gives the logits functrain computes from the params."""
    out = hf.export_directory(Path(directory) / "export", hf.load_config(directory), template, params)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.arange(T)[None] * 5 % V
    with torch.no_grad():
        theirs = loaded(input_ids=ids, use_cache=False).logits  # (logits only: recurrent_gemma's cache fails here)
    ours = ft.apply(template, params, input_ids=ids, train=False).logits
    assert_close(ours, theirs, rtol(T * 64)), "export logits"


class Outcome(NamedTuple):
    """What the family does with a model type: trains it (or not), decodes it through the KV cache (or not)."""

    training: str
    decoding: str = ""


def outcome(directory) -> Outcome:
    """What the family does with the model of `directory` (see the module docstring); asserts every claim."""
    try:
        template = hf.build_template(hf.load_config(directory))
    except hf.HFModelError as exc:
        return Outcome(f"refused: {one_line(exc)}")
    params = hf.init_params(template, rng.key(0))
    real = real_model(directory)
    check_init(template, params, real)
    data = batches(STEPS)
    want = torch_loop(real, params, data)
    assert_close(torch.tensor(functrain_losses(template, params, data)), torch.tensor(want), TOL)
    check_export(directory, template, params)
    decoded = decoding(template, params, real)
    try:
        staged = functrain_losses(template, params, data, remat="full")
    except hf.HFModelError as exc:
        return Outcome(f"unstaged only: {one_line(exc)}", decoded)
    assert_close(torch.tensor(staged), torch.tensor(want), TOL)
    check_shared(template, params)
    return Outcome("trains", decoded)


def decoding(template, params, real) -> str:
    """ "cached" once the KV cache's greedy tokens equal transformers' `generate` (2 prompts, one left-padded, 16
    new tokens), or "recomputes: <the probe's one line>"."""
    try:
        cached = hf.cached_model(template)
    except hf.HFModelError as exc:
        return f"recomputes: {one_line(exc)}"
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 0, 3, 4]])
    mask = (torch.arange(5)[None] >= torch.tensor([[0], [3]])).long()
    with torch.no_grad():
        real.load_state_dict(params, strict=False)
        want = real.eval().generate(
            ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    got = Generator(cached, block_size=32, batch_size=2, compile=False)(params, prompts, 16)
    assert [c.tokens for [c] in got] == want[:, 5:].tolist()
    return "cached"
