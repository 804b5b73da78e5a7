"""A non-finite loss or grad norm skips the update inside the step; K skips in a row stop the run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from functrain import init_state, make_train_step, optim, tree
from functrain.trainer import optimizer as trainer_optimizer

pytestmark = pytest.mark.numeric

_spec = importlib.util.spec_from_file_location(
    "gpt_config", Path(__file__).resolve().parent.parent / "configs" / "gpt.py"
)
gpt_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt_config)


def _mlp_params():
    """A small two-layer MLP's params (deterministic)."""
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(8, 16, generator=g) * 0.3,
        "b1": torch.zeros(16),
        "w2": torch.randn(16, 1, generator=g) * 0.3,
    }


def _mlp_loss(params, batch, key):
    """Mean squared error of the MLP, times `batch['scale']` (NaN or huge to force a bad step)."""
    h = torch.tanh(batch["x"] @ params["w1"] + params["b1"])  # (B, 16)
    return ((h @ params["w2"] - batch["y"]) ** 2).mean() * batch["scale"], {}


def _batch(seed, scale=1.0):
    """A regression batch; `scale` multiplies the loss."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g)
    return {"x": x, "y": x[:, :1] * 0.5, "scale": torch.tensor(scale)}


def _copy(state):
    """A deep copy of a state (every tensor cloned)."""
    return tree.map(torch.clone, state)


@pytest.mark.slow
@pytest.mark.parametrize("compile,donate", [(False, True), (False, False), (True, True)])
def test_nan_batch_skips_the_update_and_leaves_the_state_bit_identical(compile, donate):
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    step = make_train_step(_mlp_loss, opt, compile=compile, donate=donate)
    state = init_state(_mlp_params(), opt, seed=0)
    state, _ = step(state, _batch(0))  # one good step: moments and counts are non-trivial
    before = _copy(state)

    state, m = step(state, _batch(1, scale=float("nan")))
    assert float(m["skipped"]) == 1 and int(m["consecutive_skips"]) == 1 and int(m["skipped_total"]) == 1
    # every metric a float: an int64 0-d output of the compiled step is what torch 2.11's inductor put
    # into a CPU buffer on CUDA (functrain/step/update.py `_guard_after`)
    assert all(v.dtype.is_floating_point for v in m.values())
    assert not torch.isfinite(m["loss"])
    for a, b in zip(
        tree.leaves((state.params, state.opt_state, state.rng)),
        tree.leaves((before.params, before.opt_state, before.rng)),
    ):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert int(state.step) == int(before.step) + 1  # the data moves on

    # The next good batch updates exactly as if the bad one had never come.
    state, m = step(state, _batch(2))
    ref, _ = make_train_step(_mlp_loss, opt, compile=False, donate=False)(before, _batch(2))
    assert float(m["skipped"]) == 0 and int(m["consecutive_skips"]) == 0 and int(m["skipped_total"]) == 1
    # The same eager kernels on a bit-identical state and batch (donation only changes where the
    # result is written): equal up to the last bit in principle; allow float rounding of the update.
    for k in ref.params:
        scale = float(ref.params[k].abs().max())
        assert float((state.params[k] - ref.params[k]).abs().max()) <= 4 * torch.finfo(torch.float32).eps * scale, k


def test_infinite_grad_norm_with_finite_loss_is_skipped():
    """Finite gradients whose norm overflows float32 are a bad step too."""
    opt = optim.adamw(1e-2)
    step = make_train_step(_mlp_loss, opt, compile=False, donate=False)
    state = init_state(_mlp_params(), opt, seed=0)
    state2, m = step(state, _batch(0, scale=1e37))
    assert torch.isfinite(m["loss"]) and not torch.isfinite(m["grad_norm"])
    assert float(m["skipped"]) == 1
    for k in state.params:
        assert torch.equal(state2.params[k], state.params[k])


def test_without_skipping_a_nan_batch_poisons_the_params():
    """The control: with skip_nonfinite=False the same batch writes NaN into the params."""
    opt = optim.adamw(1e-2)
    step = make_train_step(_mlp_loss, opt, compile=False, skip_nonfinite=False)
    state, m = step(init_state(_mlp_params(), opt, seed=0), _batch(1, scale=float("nan")))
    assert "skipped" not in m
    assert not all(torch.isfinite(p).all() for p in state.params.values())


def _poisoned_run(tmp_path, config, bad_steps, print_fn):
    """Runs the tiny GPT job through the model-free loop with a Task whose loss is NaN on the
    batches of `bad_steps` (0-based): its batches carry a flag tensor, so the loss stays pure."""
    from functrain import parallel
    from functrain.models.gpt import task as gpt_task
    from functrain.task import Batches
    from functrain.trainer import loop

    with parallel.setup(config.mesh) as ctx:
        task = gpt_task.build(config, ctx, tmp_path / "run")

        def train_batch(step):
            x, y = task.data.train_batch(step)
            return x, y, torch.tensor(step in bad_steps)

        def loss_fn(params, batch, key):
            loss, aux = task.loss_fn(params, batch[:2], key)
            return (torch.where(batch[2], float("nan"), loss) if len(batch) > 2 else loss), aux

        data = Batches(train_batch, task.data.eval_sets, task.data.position, task.data.record)
        bad = task._replace(data=data, loss_fn=loss_fn)
        opt = trainer_optimizer.from_config(config.optim, config.steps)
        return loop.run(bad, opt, config, tmp_path / "run", ctx, print_fn=print_fn)


def _tiny_config(tmp_path, steps):
    """The tiny variant, eager, sized for a few seconds."""
    c = gpt_config.get_config("tiny")
    c.steps = steps
    c.compile = False
    c.log_every = 1
    c.eval_every = 1000
    c.checkpoint.every = 4
    c.tensorboard = False
    c.sample.max_new_tokens = 4
    c.data.cache_dir = str(tmp_path / "data")
    return c


@pytest.mark.slow
def test_one_bad_batch_is_skipped_and_the_run_finishes(tmp_path):
    torch.set_num_threads(1)
    summary = _poisoned_run(tmp_path, _tiny_config(tmp_path, 10), {5}, print_fn=lambda *a: None)
    assert summary["steps"] == 10 and summary["loss"] == summary["loss"]  # finite at the end
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    totals = {r["step"]: r["skipped_total"] for r in rows if "skipped_total" in r}
    assert totals[5] == 0 and totals[6] == 1 and totals[10] == 1
    assert all("consecutive_skips" not in r for r in rows)


@pytest.mark.slow
def test_k_consecutive_bad_steps_stop_the_run_with_one_clear_message(tmp_path):
    from functrain.trainer import loop

    torch.set_num_threads(1)
    c = _tiny_config(tmp_path, 30)
    c.max_consecutive_skips = 3
    lines = []
    with pytest.raises(loop.TrainingError) as err:
        _poisoned_run(tmp_path, c, set(range(6, 100)), print_fn=lines.append)
    msg = str(err.value)
    assert "\n" not in msg
    assert "skipped at 3 consecutive steps (7 to 9)" in msg, msg
    # Step 8's save was in flight when the limit was reached: the message waits for it and names it.
    assert "params are as after step 6" in msg and "the last checkpoint (step 8) is kept" in msg, msg
    assert "max_consecutive_skips" in msg
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] == 8


def test_apply_gradients_is_the_steps_update():
    """`apply_gradients` on grads made by hand gives exactly the step's new state."""
    from functrain import apply_gradients, value_and_grad

    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    state = init_state(_mlp_params(), opt, seed=0)
    ref, ref_m = make_train_step(_mlp_loss, opt, compile=False, donate=False)(state, _batch(0))
    loss, _, grads = value_and_grad(_mlp_loss, state.params, _batch(0), None)
    new, m = apply_gradients(state, grads, opt, aux={"loss": loss})
    for a, b in zip(tree.leaves(new), tree.leaves(ref)):
        assert torch.equal(a, b)
    assert float(m["grad_norm"]) == float(ref_m["grad_norm"]) and float(m["skipped"]) == 0
    nan_grads = tree.map(lambda g: g * float("nan"), grads)
    same, m = apply_gradients(state, nan_grads, opt)
    assert float(m["skipped"]) == 1 and all(
        torch.equal(a, b) for a, b in zip(tree.leaves(same.params), tree.leaves(state.params))
    )
