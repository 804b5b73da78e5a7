"""The loss over every target token of the step (`make_train_step(count_targets=...)`): the step's loss
and gradient equal one process's sum of cross-entropy over every target of the global batch divided by
their count, whatever accum_steps and the number of data-parallel ranks; the old mean of microbatch
means differs on the same data; a microbatch of prompts only gives no NaN; compiled, no recompiles as the
counts change."""

from __future__ import annotations

import json
import os

import _token_loss as P
import _tol
import pytest
import torch
from _dist_launch import REPO, run_ranks
from torch._dynamo.utils import counters

from functrain import init_state, make_eval_step, make_train_step, tree
from functrain.models import gpt

N_TERMS = P.ROWS * P.T * 32  # the longest reduction: every token of the batch through a 32-wide layer


def _step_grads(accum: int, *, count=P.COUNT, compile=False, staged=False):
    """(loss metric, targets metric, minus the params' move after one SGD step at lr 1 = the gradient)."""
    m = P.model()
    state = init_state(m, P.sgd())
    before = tree.clone(state.params)
    loss_fn = gpt.make_loss_fn(m, staged=staged)
    step = make_train_step(loss_fn, P.sgd(), accum_steps=accum, count_targets=count, compile=compile, donate=False)
    state, metrics = step(state, P.batch())
    grads = {k: before[k] - state.params[k] for k in before}
    return metrics, grads


def _reference():
    m = P.model()
    return P.reference_grads(m, dict(m.named_parameters()), *P.batch())


@pytest.mark.numeric
@pytest.mark.parametrize("accum", [1, 2, 4, 8])
@pytest.mark.parametrize("staged", [False, True])
def test_any_accumulation_equals_the_mean_over_every_target(accum, staged):
    ref_loss, ref_grads = _reference()
    metrics, grads = _step_grads(accum, staged=staged)
    tol = _tol.rtol(N_TERMS)
    _tol.assert_close(grads, ref_grads, tol, msg=f"accum={accum}")
    assert float(metrics["loss"]) == pytest.approx(float(ref_loss), rel=tol)
    assert int(metrics["targets"]) == int((P.batch()[1] != -1).sum())
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.numeric
def test_the_mean_of_microbatch_means_differs_on_the_same_data():
    """The negative control: without count_targets the step averages the microbatches' means, the
    semantics Hugging Face fixed in 4.46; on rows with different numbers of targets it is another
    gradient, far outside the tolerance the weighted step meets."""
    _, ref_grads = _reference()
    _, grads = _step_grads(4, count=None)
    diff = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert diff > 100 * _tol.rtol(N_TERMS) * scale


def test_a_microbatch_of_prompts_only_adds_nothing_and_no_nan():
    """Rows 2-3 (the second of 4 microbatches) hold no target: the step equals the step on the other six
    rows, and a batch of prompts only changes nothing (loss 0, gradient 0, no skip)."""
    x, y = P.batch()
    m = P.model()
    state = init_state(m, P.sgd())

    def step(accum):
        return make_train_step(
            gpt.make_loss_fn(m), P.sgd(), accum_steps=accum, count_targets=P.COUNT, compile=False, donate=False
        )

    new_all, with_empty = step(4)(state, (x, y))
    keep = torch.tensor([0, 1, 4, 5, 6, 7])
    new_rest, rest = step(3)(state, (x[keep], y[keep]))
    assert torch.isfinite(with_empty["loss"]) and int(with_empty["skipped"]) == 0
    _tol.assert_close(new_all.params, new_rest.params, _tol.rtol(N_TERMS))
    assert float(with_empty["loss"]) == pytest.approx(float(rest["loss"]), rel=_tol.rtol(N_TERMS))
    new, metrics = step(1)(state, (x[2:4], y[2:4]))
    assert float(metrics["loss"]) == 0.0 and float(metrics["grad_norm"]) == 0.0 and int(metrics["targets"]) == 0
    assert all(torch.equal(new.params[k], state.params[k]) for k in state.params)


def test_the_eval_step_weighs_by_targets():
    m = P.model()
    state = init_state(m, P.sgd())
    ref_loss, _ = _reference()
    ev = make_eval_step(gpt.make_loss_fn(m), compile=False, count_targets=P.COUNT)(state, P.batch())
    assert float(ev["loss"]) == pytest.approx(float(ref_loss), rel=_tol.rtol(N_TERMS))
    assert int(ev["targets"]) == int((P.batch()[1] != -1).sum())


@pytest.mark.slow
def test_compiled_no_recompiles_as_the_counts_change():
    m = P.model()
    state = init_state(m, P.sgd())
    torch._dynamo.reset()
    counters.clear()
    step = make_train_step(
        gpt.make_loss_fn(m), P.sgd(), accum_steps=2, count_targets=P.COUNT, compile_options={"backend": "aot_eager"}
    )
    eager = make_train_step(gpt.make_loss_fn(m), P.sgd(), accum_steps=2, count_targets=P.COUNT, compile=False)
    e_state = tree.clone(state)
    seen = set()
    for i in range(20):
        b = P.batch(seed=i)
        seen.add(int((b[1] != -1).sum()))
        state, cm = step(state, b)
        e_state, em = eager(e_state, b)
        assert float(cm["loss"]) == pytest.approx(float(em["loss"]), rel=_tol.rtol(N_TERMS) * (i + 1))
    assert len(seen) > 10  # the counts did change from step to step
    # the loss and grads; per update group kind (the blocks', the rest's) squared norms and update; the norm
    assert counters["stats"]["unique_graphs"] == 6, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])


@pytest.mark.slow
@pytest.mark.numeric
def test_two_gloo_ranks_equal_one_process(tmp_path):
    """(batch 1 x accum 4) and (batch 2 x accum 2) per rank on 2 gloo ranks, plain and per-block
    gathers (FSDP), a context-parallel pair and two pipeline stages (each rank its stage's gradient),
    and packed rows under FSDP's per-block gathers and under pipeline stages: the gradient of one
    process's mean over every target (packed: through the model's own block-causal forward)."""
    run_ranks(os.path.join(REPO, "tests", "_token_loss_worker.py"), [str(tmp_path)], 2)
    ref_loss_plain, ref_grads_plain = _reference()
    results = json.loads((tmp_path / "rank0.json").read_text())
    other = json.loads((tmp_path / "rank1.json").read_text())
    for name in ("pp_micro4", "packed_pp_micro4"):
        results[name]["grads"].update(other[name]["grads"])  # the second stage's params
    assert set(results) == {
        "dp_accum4",
        "dp_accum2",
        "fsdp_staged_accum2",
        "cp_accum2",
        "pp_micro4",
        "packed_fsdp_staged_accum2",
        "packed_pp_micro4",
    }
    m = P.model()
    packed = P.reference_packed(m, dict(m.named_parameters()), *P.packed_batch())
    for name, got in results.items():
        ref_loss, ref_grads = packed if name.startswith("packed") else (ref_loss_plain, ref_grads_plain)
        grads = {k: torch.tensor(v) for k, v in got["grads"].items()}
        _tol.assert_close(grads, ref_grads, _tol.rtol(N_TERMS), msg=name)
        assert got["loss"] == pytest.approx(float(ref_loss), rel=_tol.rtol(N_TERMS)), name
        want_targets = P.packed_batch()[1] if name.startswith("packed") else P.batch()[1]
        assert got["targets"] == int((want_targets != -1).sum()), name
