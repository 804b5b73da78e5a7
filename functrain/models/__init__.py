"""Model families. Each is a package `functrain/models/<name>/` holding the model (plain nn.Modules
with no parallelism inside and their sharding rules beside them), its loss factory, `checks.py`
(the checks of the config keys it reads, torch-free: `functrain.main` runs them before the heavy
modules load) and `task.py`, whose `build(config, ctx, workdir)` returns the `functrain.task.Task`
the training loop runs.

The trainer knows no model: outside this package only `functrain.main` imports a model family (by
the config's `model.name`).

Families: `gpt` (byte-level or BPE GPT-2 style decoder), `llama` (Llama-family decoder with Hugging Face
interop), `hf` (any transformers causal LM, built from its model directory). What decoder LMs share:
the loss factory, packed attention and sampling in `lm.py`, their data (windows or supervised examples,
tokenizer, chat template) in `lm_data.py`, their config checks in `checks.py`.
"""
