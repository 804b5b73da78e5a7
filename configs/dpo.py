"""Preference tuning (DPO) of a causal LM on chosen/rejected pairs, LoRA adapters over a frozen base, the
reference the base with the adapters off.

Command (from the repository root, no network: a tiny Qwen2 is written to the workdir, the pairs are made from
the standard library's functions: "What does json.dumps(obj, ...) do?", chosen = its docstring's summary,
rejected = the summary of another function):

    python -m functrain.main --config=configs/dpo.py

Expected result (2-core x86-64, torch 2.13, fresh workdir, ~4-5 min wall): 3,658 stdlib functions make 3,429
train and 63 held-out pairs (166 longer than 257 bytes dropped), 214.3 steps per epoch of 16 pairs; rank-8
adapters on every linear layer (38,912 of 498,816 params) over the fresh tiny Qwen2; the step compiles in
~90 s, then ~0.5-0.7 s/step. It ends printing the held-out pairs' metrics at the first evaluation and at the
last: `held out, step 100 -> 215: ... val_rewards/accuracies 0.5714 -> 0.6508, val_rewards/margins 0.04541 ->
0.1703` (before step 1 every reward is 0: the policy is its reference). A fresh 0.46M model can only learn which
summaries go with which questions from these pairs; start from the SFT job's export
(`--config.model.path=runs/sft/hf`, after `configs/sft.py`) or a trained directory for real preferences
(docs/results.md "Preference tuning").

Your own pairs and model: `--config.data.path=pairs.jsonl` (records {prompt, chosen, rejected} of text, or of
messages; `--config.data.fields` maps other names) and `--config.model.path=DIR` (any transformers causal LM
directory, e.g. the SFT job's export `runs/sft/hf`); `--config.lora.rank=0` trains every param against a
frozen copy of the starting params; `--config.preference.loss=ipo|hinge` and `--config.preference.beta` pick
the objective (docs/guide.md "Preference tuning").
"""

import ml_collections

from functrain.trainer import defaults


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    """The default preference-tuning run (the module docstring)."""
    c = defaults.trainer_config()
    c.epochs = 1.0  # over the training pairs (steps follow from it)
    c.batch_size = 16  # pairs
    c.log_every = 50
    c.eval_every = 100
    c.eval_batches = 4
    c.loss_chunk_size = 0
    c.remat = "auto"
    c.export_hf = True

    c.model = ml_collections.ConfigDict()
    c.model.name = "hf"
    c.model.path = "tiny:qwen2"  # a transformers model directory, or a tiny one of this type written to the workdir
    c.model.block_size = 256  # the longest sequence (prompt + answer, tokens), and the row length
    c.model.weights = True

    c.data = defaults.data_config()
    c.data.path = "stdlib:preference"  # or your jsonl/parquet pairs
    c.data.tokenizer = "auto"  # the directory's tokenizer.json; bytes for a 256-id model
    c.data.val_fraction = 0.02
    c.data.packing = False

    c.preference.loss = "sigmoid"
    c.preference.beta = 0.1

    c.lora.rank = 8  # 0: every param trains, the reference a frozen copy
    c.lora.alpha = 16.0

    c.optim.lr = 3e-3  # a tiny model; a trained one wants ~5e-7 (full) to 5e-6 (LoRA)
    c.optim.min_lr = 3e-4
    c.optim.warmup_steps = 30

    c.sample = ml_collections.ConfigDict()  # the answer to the first held-out prompt
    c.sample.prompt = ""
    c.sample.max_new_tokens = 60
    c.sample.temperature = 0.0  # greedy
    c.sample.top_k = 0

    if variant not in (None, "", "default"):
        raise ValueError(f"configs/dpo.py has no variant {variant!r}; it has only the default")
    return c
