"""Packing is invisible: in a packed row each document's logits and gradients equal that document run
alone, for the gpt, llama and hf families; with the document mask left out they do not (the negative
control); best-fit-decreasing fills rows; different documents per row do not recompile."""

from __future__ import annotations

import _tol
import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from functrain import apply, init_state, make_train_step, optim, rng
from functrain.data.examples import ExampleSet
from functrain.data.packing import assemble, best_fit_decreasing
from functrain.models import gpt, hf, llama, lm

T, V = 24, 64
LENGTHS = (9, 4, 7, 3)  # four documents' (input, target) pairs: 23 of a 24-token row, one pad


def _examples(seed: int = 0, lengths=LENGTHS) -> ExampleSet:
    """Documents of `lengths` pairs (each lengths + 1 tokens), every token after the first learned."""
    g = np.random.default_rng(seed)
    toks = [g.integers(1, V, n + 1) for n in lengths]
    learn = [np.r_[False, np.ones(n, bool)] for n in lengths]
    offsets = np.concatenate([[0], np.cumsum([n + 1 for n in lengths])])
    return ExampleSet(np.concatenate(toks), np.concatenate(learn), offsets)


def _families():
    """name -> (template, params, logits_fn(params, x, positions or None))."""
    g_model = gpt.GPT(
        gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32, bias=False), key=rng.key(0)
    )
    l_cfg = llama.LlamaConfig(
        vocab_size=V, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64
    )
    with torch.device("meta"):
        l_model = llama.Llama(l_cfg)
    h_model = hf.build_template(hf.load_config(_hf_dir()))

    def own(model):
        return lambda p, x, pos: apply(model, p, x, packed=None if pos is None else lm.packed(pos))

    def hf_logits(p, x, pos):
        extra = {} if pos is None else {"position_ids": pos}
        return apply(h_model, p, input_ids=x, **extra).logits

    return {
        "gpt": (g_model, dict(g_model.named_parameters()), own(g_model)),
        "llama": (l_model, llama.init_params(l_model, rng.key(0)), own(l_model)),
        "hf": (h_model, hf.init_params(h_model, rng.key(0)), hf_logits),
    }


_DIR = {}


def _hf_dir():
    """A tiny Qwen2 directory (vocabulary V), made once."""
    if "d" not in _DIR:
        import tempfile

        from functrain.models.hf.tiny import write_tiny

        _DIR["d"] = write_tiny(
            tempfile.mkdtemp(prefix="qwen2"),
            "qwen2",
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=T,
        )
    return _DIR["d"]


@pytest.fixture(scope="module")
def families():
    return _families()


def _alone_and_packed(fn, params, ex, masked=True):
    """(each document's logits alone, the same positions of the packed row) as lists of (n, V)."""
    x, _, pos = assemble(ex, [list(range(len(ex)))], T, pad_id=0)
    x, pos = torch.from_numpy(x), torch.from_numpy(pos)
    packed = fn(params, x, pos if masked else None)[0]  # (T, V)
    alone, parts, at = [], [], 0
    for i in range(len(ex)):
        xi, _ = ex.pair(i)
        alone.append(fn(params, torch.from_numpy(xi)[None], None)[0])  # (n, V)
        parts.append(packed[at : at + len(xi)])
        at += len(xi)
    return alone, parts


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["gpt", "llama", "hf"])
def test_each_document_in_a_packed_row_equals_it_alone(families, name):
    _, params, fn = families[name]
    ex = _examples()
    with torch.no_grad():
        alone, parts = _alone_and_packed(fn, params, ex)
        for a, b in zip(alone, parts):
            _tol.assert_close(b, a, _tol.rtol(T * 64))
        # the negative control: one causal sequence, the later documents see the earlier ones
        alone, parts = _alone_and_packed(fn, params, ex, masked=False)
        assert any(float((a - b).abs().max()) > 1e-3 for a, b in zip(alone[1:], parts[1:]))


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["gpt", "llama", "hf"])
def test_packed_gradients_equal_the_padded_batch(families, name):
    """The gradient of the loss over every target of one packed row equals that of the same documents padded
    one per row (the loss a token-weighted step takes over either layout)."""
    template, params, fn = families[name]
    ex = _examples()

    def loss_grads(x, y, pos):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        logits = fn(leaves, torch.from_numpy(x), None if pos is None else torch.from_numpy(pos))
        loss = lm.cross_entropy(logits, torch.from_numpy(y))
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    x, y, pos = assemble(ex, [list(range(len(ex)))], T, pad_id=0)
    packed = loss_grads(x, y, pos)
    x, y, _ = assemble(ex, [[i] for i in range(len(ex))], T, pad_id=0)
    padded = loss_grads(x, y, None)
    _tol.assert_close(packed, padded, _tol.rtol(len(ex) * T * 64))


def test_best_fit_decreasing_fills_rows():
    lengths = np.array([3, 5, 2, 4])
    assert best_fit_decreasing(lengths, 6, np.arange(4)) == [[1], [3, 2], [0]]
    g = np.random.default_rng(0)
    lengths = g.integers(1, 60, 500)
    rows = best_fit_decreasing(lengths, 64, g.permutation(500))
    assert sorted(i for r in rows for i in r) == list(range(500))  # every example once
    assert all(lengths[r].sum() <= 64 for r in rows)
    assert len(rows) <= int(np.ceil(lengths.sum() / 64 * 11 / 9)) + 1  # BFD's 11/9 OPT + 1 bound


@pytest.mark.slow
def test_different_documents_per_row_do_not_recompile():
    model = gpt.GPT(
        gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2, n_embd=32, bias=False), key=rng.key(0)
    )
    opt = optim.sgd(0.1)
    state = init_state(model, opt)
    torch._dynamo.reset()
    counters.clear()
    step = make_train_step(
        gpt.make_loss_fn(model), opt, count_targets=lm.count_targets(), compile_options={"backend": "aot_eager"}
    )
    g = np.random.default_rng(1)
    for i in range(20):
        ex = _examples(seed=i, lengths=tuple(int(n) for n in g.integers(2, 8, g.integers(2, 5))))
        rows = best_fit_decreasing(ex.lengths, T, np.arange(len(ex)))
        x, y, pos = assemble(ex, (rows + [[]] * 2)[:2], T, pad_id=0)
        state, _ = step(state, (torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(pos)))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the loss and grads, the update
    assert not counters["recompiles"], dict(counters["recompiles"])


def _staged_loss(name, template, remat):
    """The family's staged loss (each block a stage; `remat` recomputes them)."""
    if name == "hf":
        return hf.make_loss_fn(template, remat=remat, staged=True)
    return (gpt if name == "gpt" else llama).make_loss_fn(template, remat=remat, staged=True)


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["gpt", "llama", "hf"])
@pytest.mark.parametrize("remat", ["none", "full", "blocks"])
def test_staged_losses_carry_the_documents(families, name, remat):
    """The staged loss (per-block stages: what meshes, remat and pipelines run) of a packed batch equals the
    unstaged one in value and gradient: every block gets the rows' document layout."""
    template, params, _ = families[name]
    ex = _examples()
    rows = best_fit_decreasing(ex.lengths, T, np.arange(len(ex)))
    batch = tuple(torch.from_numpy(a) for a in assemble(ex, (rows + [[]])[:2], T, pad_id=0))
    plain = hf.make_loss_fn(template) if name == "hf" else (gpt if name == "gpt" else llama).make_loss_fn(template)
    staged = _staged_loss(name, template, "full" if remat == "blocks" else remat)
    if remat == "blocks":  # compile_unit="blocks": one compiled block graph shared by every block, with the layout
        torch._dynamo.reset()
        staged = staged.compile_stages({"backend": "aot_eager"})
    want_loss, want = _grads_of(plain, params, batch)
    loss, _, got = staged.value_and_grad(params, batch, None)
    assert float(loss) == pytest.approx(float(want_loss), rel=_tol.rtol(T * 64))
    _tol.assert_close(got, want, _tol.rtol(2 * T * 64))
    unmasked = _grads_of(plain, params, batch[:2])[0]
    assert abs(float(unmasked) - float(want_loss)) > 1e-4  # the layout matters on these rows


def _grads_of(loss_fn, params, batch):
    """(loss, grads) of a plain loss by autograd."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    loss, _ = loss_fn(leaves, batch, None)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return loss.detach(), {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), grads)}
