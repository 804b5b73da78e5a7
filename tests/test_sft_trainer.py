"""Fine-tuning equals Hugging Face Trainer's: a tiny Qwen2 (and functrain's own GPT, wrapped as a module
Trainer calls) on prompt/completion rows of different numbers of targets, accumulation 4, the same init
and the same rows in the same order (shuffle off on both sides): the per-step losses and the final
params of `transformers.Trainer` (which divides by `num_items_in_batch`, the targets of every
microbatch of the step) equal functrain's token-weighted step within float32 tolerance."""

from __future__ import annotations

import _tol
import numpy as np
import pytest
import torch

from functrain import init_state, make_train_step, optim, rng
from functrain.data.examples import ExampleSet
from functrain.data.packing import assemble
from functrain.data.supervised import IGNORE
from functrain.models import gpt, hf, lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

T, V, ROWS, STEPS, ACCUM, MICRO, LR = 24, 64, 32, 4, 4, 2, 0.5


def _examples() -> ExampleSet:
    """ROWS prompt/completion examples of 4 to T + 1 tokens, the prompt 1 to 12 of them."""
    g = np.random.default_rng(0)
    toks, learn = [], []
    for _ in range(ROWS):
        n = int(g.integers(4, T + 2))
        prompt = int(g.integers(1, min(12, n - 1) + 1))
        toks.append(g.integers(1, V, n))
        learn.append(np.arange(n) >= prompt)
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in toks])])
    return ExampleSet(np.concatenate(toks), np.concatenate(learn), offsets)


def _rows():
    """(x, y) of every example padded to T (functrain's layout) and (input_ids, labels) of T + 1 (HF's)."""
    ex = _examples()
    x, y, _ = assemble(ex, [[i] for i in range(len(ex))], T, pad_id=0)
    ids = np.concatenate([x, np.zeros((len(ex), 1), np.int64)], axis=1)  # (R, T + 1)
    for i in range(len(ex)):  # the example's last token after its inputs
        n = int(ex.lengths[i])
        ids[i, n] = ex.tokens[ex.offsets[i + 1] - 1]
    labels = np.concatenate([np.full((len(ex), 1), -100), np.where(y == IGNORE, -100, y)], axis=1)  # (R, T + 1)
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(ids), torch.from_numpy(labels)


class _Rows(torch.utils.data.Dataset):
    """HF rows as Trainer's dicts."""

    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i], "attention_mask": torch.ones_like(self.ids[i])}


def _trainer(model, ids, labels, tmp_path):
    """Trainer with plain SGD at a constant rate, no clipping, no decay, rows in order; returns (losses, model)."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        optim="sgd",
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(ids, labels))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, model


def _functrain(loss_fn, params, x, y):
    """functrain's token-weighted step, the same SGD, the same rows; returns (losses, params)."""
    opt = optim.sgd(LR)
    state = init_state(params, opt)
    step = make_train_step(loss_fn, opt, accum_steps=ACCUM, count_targets=lm.count_targets(), compile=False)
    losses, rows = [], MICRO * ACCUM
    for s in range(STEPS):
        state, m = step(state, (x[s * rows : (s + 1) * rows], y[s * rows : (s + 1) * rows]))
        losses.append(float(m["loss"]))
    return losses, state.params


def _tiny_qwen2(tmp_path):
    """(the hf family's template, its init, the transformers model with the same weights)."""
    from functrain.models.hf.tiny import write_tiny

    d = write_tiny(
        tmp_path / "qwen2",
        "qwen2",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T + 1,
    )
    config = hf.load_config(d)
    template = hf.build_template(config)
    params = hf.init_params(template, rng.key(0))
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(params, strict=True)
    return template, params, model


@pytest.mark.slow
@pytest.mark.numeric
def test_qwen2_equals_transformers_trainer(tmp_path):
    x, y, ids, labels = _rows()
    template, params, model = _tiny_qwen2(tmp_path)
    ours, final = _functrain(hf.make_loss_fn(template), {k: v.clone() for k, v in params.items()}, x, y)
    theirs, model = _trainer(model, ids, labels, tmp_path / "out")
    tol = _tol.rtol(MICRO * T * 64 * STEPS)
    np.testing.assert_allclose(ours, theirs, rtol=tol)
    _tol.assert_close(final, dict(model.named_parameters()), tol)
    moved = max(float((final[k] - params[k]).abs().max()) for k in params)
    assert moved > 100 * tol  # the runs moved the params: not a comparison of constants


class _GPTForTrainer(torch.nn.Module):
    """functrain's GPT as a module Trainer calls: the loss over the labels' targets divided by
    `num_items_in_batch` (how Trainer's own models reduce; its `model_accepts_loss_kwargs`)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, attention_mask=None, num_items_in_batch=None, **kwargs):
        logits = self.model(input_ids)[:, :-1]  # (B, T, V): the next-token logits of positions 0..T-1
        target = labels[:, 1:]
        total = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100, reduction="sum"
        )
        n = num_items_in_batch if num_items_in_batch is not None else (target != -100).sum()
        return {"loss": total / n}


@pytest.mark.slow
@pytest.mark.numeric
def test_own_gpt_equals_transformers_trainer(tmp_path):
    x, y, ids, labels = _rows()
    cfg = gpt.GPTConfig(vocab_size=V, block_size=T + 1, n_layer=2, n_head=2, n_embd=32, bias=False)
    model = gpt.GPT(cfg, key=rng.key(0))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ours, final = _functrain(gpt.make_loss_fn(model), params, x, y)
    theirs, wrapped = _trainer(_GPTForTrainer(model), ids, labels, tmp_path / "out")
    tol = _tol.rtol(MICRO * T * 64 * STEPS)
    np.testing.assert_allclose(ours, theirs, rtol=tol)
    _tol.assert_close(final, {k: v for k, v in wrapped.model.named_parameters()}, tol)
