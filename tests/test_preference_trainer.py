"""Preference tuning equals TRL's DPOTrainer step by step: a tiny Qwen2 on text pairs (a tokenizer shaped as
Qwen2.5 ships it; conversations render as TRL's in tests/test_preference_data.py), TRL rendering and batching its
own data, accumulation 2, the same init, the same pairs in the same order (shuffle off), plain SGD; the per-step
losses, the reward metrics and the final params of `trl.DPOTrainer` (its reference model a copy of the starting
weights) equal functrain's step over the hf family's template, `functrain.data.pairs` rows and
`functrain.preference`'s loss with the reference frozen in the state."""

from __future__ import annotations

import copy
import tempfile

import _tokenizer_dirs as dirs
import _tol
import numpy as np
import pytest
import transformers
from datasets import Dataset

from functrain import functional, init_state, make_train_step, optim, preference, rng
from functrain.data import pairs as pairs_lib
from functrain.data import supervised as S
from functrain.data.tokenizer import HFTokenizer
from functrain.models import hf

STEPS, ACCUM, MICRO, LR, BETA = 3, 2, 2, 0.5, 0.5

RECORDS = [
    {"prompt": "def add(a, b):", "chosen": "\n    return a + b\n", "rejected": "\n    return a - b\n"},
    {"prompt": "The quick brown fox", "chosen": " jumps over the lazy dog.", "rejected": " sleeps."},
    {"prompt": "What does json.dumps do?", "chosen": " It serializes an object.", "rejected": " Nothing"},
    {"prompt": "hello there,", "chosen": " how are you today?", "rejected": " what?"},
] * 3  # 12 pairs: STEPS x ACCUM x MICRO


def _trl(model, reference, tok_dir, out):
    """DPOTrainer with plain SGD at a constant rate, no clipping, pairs in order; returns (log history, model)."""
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(out),
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
        bf16=False,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=None,
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(RECORDS), processing_class=tok
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], model


def _functrain(template, params, tok_dir):
    """functrain's step on the same pairs, the same SGD; returns (per-step metrics, params)."""
    tok = HFTokenizer(tok_dir)
    pairs = [
        pairs_lib.render_pair(r, tok, template=S.chat_template_of(tok_dir, tok.special.template_vars()))
        for r in RECORDS
    ]
    logits_fn = lambda p, x, key: functional.apply(template, p, input_ids=x).logits  # noqa: E731
    loss_fn = preference.make_loss_fn(
        logits_fn, preference.Preference("sigmoid", BETA), reference=preference.reference_of
    )
    opt = optim.sgd(LR)
    state = init_state(params, opt, frozen=preference.frozen_reference(params))
    step = make_train_step(loss_fn, opt, accum_steps=ACCUM, count_targets=preference.count_pairs(), compile=False)
    out, n = [], MICRO * ACCUM
    for s in range(STEPS):
        x, y, dropped = pairs_lib.pair_rows(
            pairs[s * n : (s + 1) * n], max_length=10_000, pad_id=tok.special.pad_id or 0
        )
        assert dropped == 0
        state, m = step(state, (x, y))
        out.append({k: float(v) for k, v in m.items()})
    return out, state.params


@pytest.mark.slow
@pytest.mark.numeric
def test_dpo_equals_trls_dpo_trainer(tmp_path):
    tok_dir = dirs.write(tempfile.mkdtemp() + "/qwen", "qwen2.5")
    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    template = hf.build_template(config)
    params = hf.init_params(template, rng.key(0))
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(params, strict=False)
    reference = copy.deepcopy(model)
    ours, final = _functrain(template, {k: v.clone() for k, v in params.items()}, tok_dir)
    theirs, model = _trl(model, reference, tok_dir, tmp_path / "out")
    assert len(theirs) == STEPS
    tol = _tol.rtol(MICRO * 64 * 32 * STEPS)
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        absolute = name.startswith("rewards/")  # (0 at the first step: compared to the scale of the logps)
        got, want = np.array([m[name] for m in ours]), np.array([h[name] for h in theirs])
        scale = 1.0 if not absolute else float(np.abs([m["logps/chosen"] for m in ours]).max())
        np.testing.assert_allclose(
            got, want, rtol=0 if absolute else tol, atol=tol * scale if absolute else 0, err_msg=name
        )
    assert [m["rewards/accuracies"] for m in ours] == pytest.approx([h["rewards/accuracies"] for h in theirs])
    named = dict(model.named_parameters())
    _tol.assert_close({k: final[k] for k in named}, named, tol)
    moved = max(float((final[k] - params[k]).abs().max()) for k in named)
    assert moved > 100 * tol and ours[-1]["rewards/margins"] > ours[0]["rewards/margins"]
