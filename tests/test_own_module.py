"""Your own module: model state (BatchNorm), train/eval modes, dropout from the key, graph breaks, meta templates.

Every numeric test compares against a plain PyTorch loop (`_bn_model.torch_loop`) or against
functrain's own eager run. The CNN's conv has no bias (BatchNorm removes it: its gradient would be
rounding noise, which AdamW turns into full-size steps in any run), so 20 AdamW steps stay
comparable; the losses and running statistics are compared with tolerances from float32's epsilon
and the reduction length (tests/_tol.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from _bn_model import CNN, batches, loss_fn_for, model, optimizer, torch_loop
from _tol import assert_close, rtol
from torch import nn

import functrain as ft
from functrain import checkpoint, optim, per_example, population, rng
from functrain.compiler import GraphBreakError
from functrain.state import init_guard

STEPS = 20
# A loss is a mean over 16 rows of a conv over 27 inputs: reductions of ~500 terms per step, and
# 20 steps feed each one's rounding back into the next (x STEPS).
TOL = rtol(16 * 27 * 8) * STEPS


def _train(step, state, data):
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_batchnorm_trains_like_the_torch_loop(compile):
    template = model(0)
    data = batches(STEPS)
    want_losses, net = torch_loop(template, data)
    template.eval()  # the step sets the mode itself
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    state = ft.init_state(template, optimizer(), seed=0)
    assert list(state.model_state) == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    state, losses = _train(ft.make_train_step(loss_fn_for(template), optimizer(), compile=compile), state, data)
    assert_close(torch.tensor(losses), torch.tensor(want_losses), TOL)
    assert_close(state.model_state["bn.running_mean"], net.bn.running_mean, TOL)
    assert_close(state.model_state["bn.running_var"], net.bn.running_var, TOL)
    assert int(state.model_state["bn.num_batches_tracked"]) == int(net.bn.num_batches_tracked) == STEPS
    # the template was never written, and its mode is the one it was left in
    assert int(template.bn.num_batches_tracked) == 0 and not template.training
    assert torch.equal(template.bn.running_mean, torch.zeros(8))
    if compile:  # the loss and grads, then the update with the model state
        assert counters["stats"]["unique_graphs"] == 2 and not counters["recompiles"], dict(counters["recompiles"])
    x, y = batches(1, seed=5)[0]
    got = ft.make_eval_step(loss_fn_for(template), compile=compile)(state, (x, y))["loss"]
    with torch.no_grad():
        want = F.cross_entropy(net.eval()(x), y)
    assert_close(got, want, TOL)


@pytest.mark.numeric
def test_accumulation_updates_the_statistics_once_per_microbatch():
    template = model(0)
    data = batches(3)
    net = CNN()
    net.load_state_dict(template.state_dict())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for x, y in data:  # torch's accumulation loop: two forwards, each updating the statistics
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            loss = F.cross_entropy(net(xs), ys) / 2
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        want.append(total)
    state = ft.init_state(template, optimizer())
    state, losses = _train(
        ft.make_train_step(loss_fn_for(template), optimizer(), accum_steps=2, compile=False), state, data
    )
    assert_close(torch.tensor(losses), torch.tensor(want), TOL)
    assert_close(state.model_state["bn.running_mean"], net.bn.running_mean, TOL)
    assert int(state.model_state["bn.num_batches_tracked"]) == 6


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_under_half_precision_the_buffers_keep_their_dtype(precision):
    template = model(0)
    # (a scale that does not overflow at the first step: a skipped step keeps the old statistics)
    state = ft.init_state(template, optimizer()).replace(guard=init_guard(loss_scale=2.0**8))
    fp32, _ = _train(
        ft.make_train_step(loss_fn_for(template), optimizer(), compile=False),
        ft.init_state(template, optimizer()),
        batches(3),
    )
    state, _ = _train(
        ft.make_train_step(loss_fn_for(template), optimizer(), compile=False, precision=precision), state, batches(3)
    )
    assert state.model_state["bn.running_mean"].dtype == torch.float32
    assert state.model_state["bn.num_batches_tracked"].dtype == torch.int64
    assert int(state.model_state["bn.num_batches_tracked"]) == 3 and int(state.guard.skipped) == 0
    # computed in half precision (8 or 11 bits of mantissa): close to the fp32 run, not equal
    assert_close(state.model_state["bn.running_var"], fp32.model_state["bn.running_var"], 0.05)
    assert not torch.equal(state.model_state["bn.running_var"], fp32.model_state["bn.running_var"])


def test_a_skipped_update_keeps_the_old_statistics():
    template = model(0)
    state = ft.init_state(template, optimizer())
    before = {k: v.clone() for k, v in state.model_state.items()}
    x, y = batches(1)[0]
    x[0, 0, 0, 0] = float("nan")
    state, m = ft.make_train_step(loss_fn_for(template), optimizer(), compile=False)(state, (x, y))
    assert float(m["skipped"]) == 1.0
    assert all(torch.equal(state.model_state[k], before[k]) for k in before)


@pytest.mark.numeric
@pytest.mark.parametrize("left_in", ["train", "eval"])
def test_eval_runs_in_eval_mode_whatever_mode_the_template_is_in(left_in):
    template = model(0)
    data = batches(4)
    _, net = torch_loop(template, data[:3])
    state = ft.init_state(template, optimizer())
    state, _ = _train(ft.make_train_step(loss_fn_for(template), optimizer(), compile=False), state, data[:3])
    template.train(left_in == "train")
    before = {k: v.clone() for k, v in state.model_state.items()}
    got = ft.make_eval_step(loss_fn_for(template), compile=False)(state, data[3])["loss"]
    net.eval()
    with torch.no_grad():
        want = F.cross_entropy(net(data[3][0]), data[3][1])
    assert_close(got, want, TOL)
    assert all(torch.equal(state.model_state[k], before[k]) for k in before)  # eval updates nothing
    assert template.training == (left_in == "train")


def test_a_state_with_buffers_needs_a_loss_that_takes_them():
    template = model(0)
    state = ft.init_state(template, optimizer())

    def loss_fn(params, batch, key):
        return F.cross_entropy(ft.apply(template, params, batch[0]), batch[1])

    with pytest.raises(
        TypeError, match="takes \\(params, batch, key\\): write loss_fn\\(params, batch, key, model_state\\)"
    ):
        ft.make_train_step(loss_fn, optimizer(), compile=False)(state, batches(1)[0])


def test_per_example_gradients_refuse_a_model_state():
    template = model(0)
    state = ft.init_state(template, optimizer())
    with pytest.raises(ValueError, match="batch of one.*GroupNorm or LayerNorm"):
        per_example.grads(lambda p, b, k: 0, state.params, batches(1)[0], model_state=state.model_state)


def test_a_population_trains_each_members_statistics():
    template = model(0)
    data = batches(3)
    opt = optimizer()
    members = [ft.init_state(model(s), opt, seed=s) for s in range(2)]
    pop = population.stack(members)
    step = population.make_population_step(loss_fn_for(template), opt, compile=False)
    for b in data:
        pop, _ = step(pop, b)
    for s in range(2):  # each member as its own run
        solo, _ = _train(
            ft.make_train_step(loss_fn_for(template), opt, compile=False), ft.init_state(model(s), opt, seed=s), data
        )
        got = population.member(pop, s).model_state
        assert_close(got["bn.running_mean"], solo.model_state["bn.running_mean"], TOL)
        assert int(got["bn.num_batches_tracked"]) == 3


def test_checkpoints_hold_the_model_state(tmp_path):
    template = model(0)
    state = ft.init_state(template, optimizer())
    state, _ = _train(ft.make_train_step(loss_fn_for(template), optimizer(), compile=False), state, batches(2))
    with checkpoint.Manager(str(tmp_path / "new")) as mgr:
        mgr.save(2, state)
        mgr.wait()
        fresh = ft.init_state(model(1), optimizer())
        back = mgr.restore(2, checkpoint.abstract(fresh)).result()
    assert all(torch.equal(back.model_state[k], state.model_state[k]) for k in state.model_state)
    assert torch.equal(back.params["conv.weight"], state.params["conv.weight"])


# --- dropout from the key -------------------------------------------------------------------------


class _Dropouts(nn.Module):
    """Every kind of dropout torch has, one after another, on a linear layer's output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):  # x: (B, 8)
        h = self.drop(self.lin(x))
        h = F.dropout(h, 0.2, training=self.training)
        h = F.alpha_dropout(h, 0.1, training=self.training)
        h = F.dropout1d(h.view(-1, 4, 2), 0.1, training=self.training).view(-1, 8)  # (B, 4, 2) channels
        q = h.view(-1, 2, 2, 2)  # (B, H, T, D)
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1 if self.training else 0.0).reshape(-1, 8)
        return h


def _dropout_run(compile, steps=3, seed=0, state=None):
    torch.manual_seed(0)
    net = _Dropouts()

    def loss_fn(params, batch, key):
        return ft.apply(net, params, batch).pow(2).mean()

    opt = optim.sgd(0.1)
    state = ft.init_state(net, opt, seed=seed) if state is None else state
    step = ft.make_train_step(loss_fn, opt, compile=compile)
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(16, 8, generator=g) for _ in range(6)]
    losses = []
    for i in range(int(state.step), int(state.step) + steps):
        state, m = step(state, data[i])
        losses.append(float(m["loss"]))
    return state, losses


def test_dropout_inside_modules_follows_the_key():
    torch.manual_seed(123)
    _, a = _dropout_run(False)
    torch.manual_seed(456)  # torch's global generator plays no part
    _, b = _dropout_run(False)
    _, c = _dropout_run(False, seed=1)
    assert a == b
    assert a != c


def test_resume_with_dropout_is_bit_exact(tmp_path):
    whole, losses = _dropout_run(False, steps=6)
    half, first = _dropout_run(False, steps=3)
    with checkpoint.Manager(str(tmp_path)) as mgr:
        mgr.save(3, half)
        mgr.wait()
        restored = mgr.restore(3, checkpoint.abstract(half)).result()
    done, second = _dropout_run(False, steps=3, state=restored)
    assert first + second == losses
    assert all(torch.equal(done.params[k], whole.params[k]) for k in whole.params)


@pytest.mark.slow
@pytest.mark.numeric
def test_compiled_dropout_equals_eager():
    eager, a = _dropout_run(False)
    compiled, b = _dropout_run(True)
    # the masks are the same draws (one opaque op); only the matmuls' rounding differs
    assert_close(torch.tensor(b), torch.tensor(a), rtol(64))
    for k in eager.params:
        assert_close(compiled.params[k], eager.params[k], rtol(64))


def test_keyed_dropout_matches_torchs_statistics():
    x = torch.ones(200_000)
    with ft.nn.keyed(rng.key(0)):
        y = F.dropout(x, 0.25)
        z = F.alpha_dropout(torch.randn(200_000, generator=torch.Generator().manual_seed(0)), 0.2, training=True)
        w = F.dropout2d(torch.ones(4000, 50, 2, 2), 0.5)
    assert abs(float((y == 0).float().mean()) - 0.25) < 0.01 and abs(float(y.mean()) - 1.0) < 0.01
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1.0) < 0.02  # alpha dropout keeps mean and variance
    per_channel = w.flatten(2)
    assert bool(((per_channel == 0).all(-1) | (per_channel == 2).all(-1)).all())  # whole channels


def test_population_members_draw_different_masks():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Dropout(0.5))

    def loss_fn(params, batch, key):
        out = ft.apply(net, params, batch)  # (B, 64)
        return out.mean() * 0.0, {"mask": (out * torch.arange(64.0)).sum()}  # the mask as one number

    opt = optim.sgd(0.1)
    w = torch.zeros(())

    def loss(params, batch, key):
        out = loss_fn(params, batch, key)
        return out[0] + params["w"] * 0.0, out[1]

    pop = population.stack([ft.init_state({"w": w.clone()}, opt, seed=s) for s in range(4)])
    _, m = population.make_population_step(loss, opt, compile=False)(pop, torch.ones(1, 64))
    assert len(set(m["mask"].tolist())) == 4


# --- graph breaks -----------------------------------------------------------------------------------

_log = logging.getLogger("my_model")


class _Breaks(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "print":
            print("forward")
        elif self.kind == "logging":
            _log.info("forward")
        elif self.kind == "branch":
            if h.sum() > 0:  # a branch on a tensor's value
                h = h * 2
        return h


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,reason",
    [("print", "builtin operator"), ("logging", "logging.Logger"), ("branch", "Data-dependent branching")],
)
def test_a_graph_break_stops_with_one_line_and_fullgraph_false_trains_without_recompiles(kind, reason):
    torch.manual_seed(0)
    net = _Breaks(kind)

    def loss_fn(params, batch, key):
        return ft.apply(net, params, batch).pow(2).mean()

    opt = optim.sgd(0.1)
    xs = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) * (-1) ** i for i in range(4)]
    with pytest.raises(GraphBreakError) as e:
        ft.make_train_step(loss_fn, opt)(ft.init_state(net, opt), xs[0])
    line = str(e.value)
    assert "\n" not in line and reason in line and "fullgraph=False" in line
    assert f"{__file__}:" in line and "(in forward)" in line  # the user's own file and line
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step = ft.make_train_step(loss_fn, opt, fullgraph=False)
    state, compiled = _train(step, ft.init_state(net, opt), xs)
    _, eager = _train(ft.make_train_step(loss_fn, opt, compile=False), ft.init_state(net, opt), xs)
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert counters["stats"]["unique_graphs"] >= 2  # compiled around the break
    assert_close(torch.tensor(compiled), torch.tensor(eager), rtol(32))


# --- meta templates ---------------------------------------------------------------------------------


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):  # (B, T) -> (B, T, 16)
        return self.head(self.emb(idx))


def test_a_meta_template_whose_ties_to_meta_broke_is_refused():
    torch.manual_seed(0)
    real = _Tied()
    params = ft.params_of(real)  # one tensor for the tied pair, under its first name
    assert list(params) == ["emb.weight"]
    broken = _Tied().to("meta")  # `.to("meta")` unties head.weight from emb.weight
    with pytest.raises(
        ValueError,
        match=r"meta device .*parameter head\.weight \[16, 8\] \(tied to emb\.weight\?.*"
        r"torch\.device\('meta'\)",
    ):
        ft.apply(broken, params, torch.zeros(1, 3, dtype=torch.long))
    with torch.device("meta"):
        good = _Tied()  # ties kept
    want = real(torch.arange(3)[None])
    assert torch.equal(ft.apply(good, params, torch.arange(3)[None]), want)


def test_a_buffer_left_on_meta_is_refused():
    with torch.device("meta"):
        template = CNN()
    real = model(0)
    params = ft.params_of(real)
    x = torch.randn(2, 3, 6, 6)
    with pytest.raises(ValueError, match=r"buffer bn\.running_mean \[8\].*buffers_of"):
        ft.apply(template, params, x)
    out, _ = ft.apply(template, params, x, model_state=ft.nn.buffers_of(real), train=False)
    real.eval()
    assert torch.equal(out, real(x))


# --- a transformers model with dropout ------------------------------------------------------------


def _gpt2(layers=1):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)

    def loss_fn(params, batch, key):
        x, y = batch
        logits = ft.apply(model, params, input_ids=x).logits  # (B, T, 64)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return model, loss_fn


def _token_batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)) for _ in range(n)]


@pytest.mark.slow
def test_a_transformers_model_draws_its_dropout_from_the_key(tmp_path):
    model, loss_fn = _gpt2()
    opt = optim.adamw(1e-3)
    data = _token_batches(6)
    step = ft.make_train_step(loss_fn, opt, compile=False)
    torch.manual_seed(1)
    whole, a = _train(step, ft.init_state(model, opt, seed=0), data)
    torch.manual_seed(2)
    _, b = _train(step, ft.init_state(model, opt, seed=0), data)
    _, c = _train(step, ft.init_state(model, opt, seed=1), data)
    assert a == b and a != c
    half, first = _train(step, ft.init_state(model, opt, seed=0), data[:3])  # stop at 3, resume
    with checkpoint.Manager(str(tmp_path)) as mgr:
        mgr.save(3, half)
        mgr.wait()
        restored = mgr.restore(3, checkpoint.abstract(half)).result()
    done, second = _train(step, restored, data[3:])
    assert first + second == a
    assert all(torch.equal(done.params[k], whole.params[k]) for k in whole.params)
    # 4 population members, 4 seeds: 4 different masks, so 4 different first losses
    pop = population.stack([ft.init_state(model, opt, seed=s) for s in range(4)])
    _, m = population.make_population_step(loss_fn, opt, compile=False)(pop, data[0])
    assert len(set(m["loss"].tolist())) == 4


@pytest.mark.slow
@pytest.mark.numeric
def test_a_compiled_transformers_model_with_dropout_equals_eager():
    model, loss_fn = _gpt2()
    opt = optim.adamw(1e-3)
    data = _token_batches(3)
    _, eager = _train(ft.make_train_step(loss_fn, opt, compile=False), ft.init_state(model, opt), data)
    _, compiled = _train(ft.make_train_step(loss_fn, opt), ft.init_state(model, opt), data)
    assert_close(torch.tensor(compiled), torch.tensor(eager), rtol(16 * 64 * 32))


# --- data parallel ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.numeric
def test_two_data_parallel_ranks_keep_the_statistics_each_sync_promises(tmp_path):
    """2 gloo ranks, each normalizing with its own rows' statistics; "broadcast" keeps rank 0's running
    statistics (DDP), "mean" their mean; against the torch loop emulating both ranks in one process."""
    import json
    import os

    from _dist_launch import run_ranks

    run_ranks(os.path.join(os.path.dirname(__file__), "_model_state_worker.py"), [str(tmp_path)], nprocs=2, timeout=600)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    steps = len(ranks[0]["broadcast-eager"]["losses"])
    wanted = {sync: torch_loop(model(0), batches(steps), shards=2, sync=sync) for sync in ("broadcast", "mean")}
    for name, got in ranks[0].items():
        sync = name.split("-")[0]
        losses, net = wanted[sync]
        assert got == ranks[1][name], f"{name}: the ranks disagree"  # replicated: the same on both
        assert_close(torch.tensor(got["losses"]), torch.tensor(losses), TOL, msg=name)
        for k, buf in net.named_buffers():
            assert_close(torch.tensor(got["model_state"][k], dtype=buf.dtype), buf, TOL, msg=f"{name} {k}")
    b, m = (torch.tensor(ranks[0][f"{s}-eager"]["model_state"]["bn.running_mean"]) for s in ("broadcast", "mean"))
    assert (b - m).abs().max() > 10 * TOL * m.abs().max()  # the two semantics really differ on these batches


# --- the loop trains a Task with model state ------------------------------------------------------


def _bn_task(template):
    from functrain import parallel
    from functrain.task import Batches, Task

    data = batches(20)
    return Task(
        describe="BatchNorm CNN",
        init_params=lambda key, device: {k: v.clone() for k, v in ft.params_of(template).items()},
        shard_rules=parallel.FSDP_RULES,
        loss_fn=loss_fn_for(template),
        data=Batches(lambda step: data[step % len(data)], lambda: data[:2]),
        tokens_per_step=16,
        flops_per_token=0.0,
        finish=lambda params, key: {},
        init_model_state=lambda device: {k: v.clone() for k, v in ft.nn.buffers_of(template).items()},
    )


def _loop_run(tmp_path, workdir, stop_at=0):
    from configs import gpt as gpt_config
    from functrain import parallel
    from functrain.trainer import loop

    c = gpt_config.get_config("tiny")
    c.steps, c.stop_at, c.compile, c.log_every, c.eval_every = 20, stop_at, False, 1, 10
    c.checkpoint.every, c.tensorboard = 10, False
    with parallel.setup(c.mesh) as ctx:
        return loop.run(_bn_task(model(0)), optimizer(), c, workdir, ctx, print_fn=lambda *a: None)


@pytest.mark.slow
def test_the_loop_trains_a_task_with_model_state_and_resumes_bit_exactly(tmp_path):
    import json

    torch.set_num_threads(1)
    _loop_run(tmp_path, tmp_path / "whole")
    assert _loop_run(tmp_path, tmp_path / "split", stop_at=10).get("preempted")
    _loop_run(tmp_path, tmp_path / "split")  # resumes from step 10

    def losses(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    whole, split = losses("whole"), losses("split")
    assert sorted(whole) == list(range(1, 21)) and all(whole[s] == split[s] for s in whole)
    states = []
    for run in ("whole", "split"):
        with checkpoint.Manager(str(tmp_path / run / "checkpoints")) as mgr:
            states.append(mgr.restore(20).result())
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(states[0]["model_state"][k], states[1]["model_state"][k]), k
    assert int(states[0]["model_state"]["bn.num_batches_tracked"]) == 20


# --- errors that fit -------------------------------------------------------------------------------


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_recurrent_module_names_the_way_that_works(cell):
    """LSTM/GRU under the one-graph step: their own line naming fullgraph=False; with it, the eager numbers."""
    rnn = cell(4, 8, batch_first=True)

    def loss_fn(params, batch, key):
        return ft.apply(rnn, params, batch)[0].pow(2).mean()

    opt = optim.sgd(0.1)
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    aot = {"backend": "aot_eager"}
    with pytest.raises(
        GraphBreakError,
        match=r"torch.compile does not trace nn.RNN, nn.GRU or nn.LSTM .*build the step "
        r"with fullgraph=False \(--config.fullgraph=False\)",
    ):
        ft.make_train_step(loss_fn, opt, compile_options=aot)(ft.init_state(rnn, opt), x)
    _, eager = ft.make_train_step(loss_fn, opt, compile=False)(ft.init_state(rnn, opt), x)
    _, pieces = ft.make_train_step(loss_fn, opt, compile_options=aot, fullgraph=False)(ft.init_state(rnn, opt), x)
    assert_close(pieces["loss"], eager["loss"], rtol(5 * 8 * 4))


def test_a_meta_refusal_keeps_its_line_in_the_compiled_step_and_init_state_refuses_meta():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = {"0.weight": torch.randn(4, 4), "0.bias": torch.zeros(4)}  # the second layer's are missing

    def loss_fn(p, batch, key):
        return ft.apply(net, p, batch).sum()

    opt = optim.sgd(0.1)
    step = ft.make_train_step(loss_fn, opt, compile_options={"backend": "aot_eager"})
    with pytest.raises(
        ValueError,
        match=r"functrain.apply: the template would compute with 2 tensor\(s\) on the meta "
        r"device .*parameter 1.weight \[2, 4\]",
    ):
        step(ft.init_state(params, opt), torch.randn(2, 4))
    with pytest.raises(
        ValueError,
        match=r"functrain.init_state: 4 tensor\(s\) are on the meta device \(0.bias, "
        r"0.weight, 1.bias, ...\): a meta template has no numbers",
    ):
        ft.init_state(net, opt)


class _Counting(nn.Module):
    """A forward that counts its calls in a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("compile", [False, True])
def test_a_forward_writing_a_buffer_the_state_does_not_carry_is_refused_until_the_state_carries_it(compile):
    net = _Counting()

    def loss_fn(params, batch, key, model_state=None):
        if model_state is None:
            return ft.apply(net, params, batch).sum()
        out, model_state = ft.apply(net, params, batch, model_state=model_state)
        return out.sum(), {}, model_state

    opt = optim.sgd(0.1)
    options = {"backend": "aot_eager"} if compile else None
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"functrain.apply: the forward wrote into buffer\(s\) calls of the template"):
        ft.make_train_step(lambda p, b, k: loss_fn(p, b, k), opt, compile=compile, compile_options=options)(
            ft.init_state(net, opt), x
        )
    net.calls.zero_()  # (the refused call had counted once into the template)
    state = ft.init_state(net, opt, model_state=ft.nn.buffers_of(net, persistent=False))
    step = ft.make_train_step(loss_fn, opt, compile=compile, compile_options=options)
    for _ in range(3):
        state, _ = step(state, x)
    assert float(state.model_state["calls"]) == 3.0 and float(net.calls) == 0.0  # the state's, not the template's
