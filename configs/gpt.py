"""Byte-level GPT on the Python standard library's sources (no network needed).

Command (from the repository root):

    python -m functrain.main --config=configs/gpt.py

Expected result (2 CPU cores, torch 2.13), measured from a fresh clone with the README's command
(14 minutes in all, pip included): 40-50 s of cold compilation (~9 s warm: `compile_cache`), then
0.26-0.31 s/step for 2500 steps; train loss falls from ~5.6 (ln 256, uniform over bytes) to 1.14,
val loss 1.26 at the end (1.1408 and 1.2554 measured), and the final sample looks like indented Python (`def`, `raise
ValueError(...)`, `return`). The built-in multiple-choice task (`eval.tasks=auto`: next_lines, 500
questions from the held-out files, chance 25%) logs `mc/next_lines/acc` 0.25 at step 0 and 0.39
(`acc_norm` 0.42) at step 2500.
Metrics land in `runs/gpt/metrics.jsonl`, TensorBoard events in `runs/gpt/tb`.

Variants (`--config=configs/gpt.py:<variant>`):
  tiny   smoke test: under a minute (~30 s of it compiling); loss ~5.6 -> 2.83, val 2.89 at step 150.
  gpt2   GPT-2 small (124M with a 50304 vocab; 85M non-embedding) for a GPU: point data.path at
         nanoGPT-style uint16 .bin files (e.g. OpenWebText) and set the batch to your memory.

Override anything: `--config.optim.lr=3e-4 --config.steps=2000 --config.model.n_layer=6`.
Your data: `--config.data.path='/data/web/*.parquet' --config.data.sampling=epochs` (parquet/jsonl
shards, tokenized in parallel once; mixtures of sources in a config file: docs/guide.md "Data").
The compile unit stays "step" by measurement (the loss's forward one graph with its backward, as
torch.compile(model) compiles a module; the update after it). `--config.optim.fused=True` (torch's fused
AdamW kernel after the compiled loss: no update graph) compiles a 4-layer GPT of width 256 cold in
torch.compile's time (0.99x; 1.67x with the compiled update, the default, which keeps this run's numbers bit
for bit); `--config.compile_unit=blocks` 0.89x but steps up to ~4% slower (docs/results.md, README "Compile
units"); a warm start loads the saved step (~3 s) either way.
LoRA over a pretrained run: `--config.checkpoint.init_from=runs/gpt --config.lora.rank=8` in a new workdir
(the base read from that checkpoint and frozen; docs/guide.md "LoRA").
Multi-process: `torchrun --standalone --nproc_per_node=2 -m functrain.main --config=configs/gpt.py`.
"""

import ml_collections

from functrain.trainer import defaults


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    """The default run, or one of the variants named in the module docstring."""
    c = defaults.trainer_config()
    c.steps = 2500  # ~0.27 s/step on 2 CPU cores: about 12 minutes
    c.loss_chunk_size = 0  # > 0: chunked cross-entropy through the tied head; logits never whole
    # activation checkpointing: auto | none | full | N (every N-th block); see bench/remat.py. "auto":
    # none on one process; full on a mesh, where a recomputed block's gathered params are freed after
    # its forward and gathered again for its backward, so no rank ever holds the whole model.
    c.remat = "auto"

    c.model = ml_collections.ConfigDict()
    c.model.name = "gpt"  # the model family: functrain/models/<name>/
    c.model.vocab_size = 0  # 0 = take it from the data (256 for bytes)
    c.model.block_size = 128
    c.model.n_layer = 4
    c.model.n_head = 4
    c.model.n_embd = 128
    c.model.dropout = 0.0  # small model, 2500 steps, 30 MB of text: it does not overfit
    c.model.bias = False

    c.data = defaults.data_config()  # path, cache_dir, text_field, sampling, sources, mixture, ...
    c.data.path = "stdlib"  # the Python standard library's sources: offline everywhere

    c.optim.lr = 3e-3  # high for a GPT, fine for a 0.8M-param byte model with warm-up
    c.optim.min_lr = 3e-4

    # Multiple-choice evaluation every eval_every steps. "auto": next_lines (which of 4 lines follows a
    # context of held-out code, functrain/eval/next_lines.py; chance 25%) where the data is text, else
    # none (said in one line). HellaSwag too: --config.eval.tasks=next_lines,<hellaswag_val.jsonl>
    c.eval.tasks = "auto"

    c.sample = ml_collections.ConfigDict()
    c.sample.prompt = "def "
    c.sample.max_new_tokens = 300
    c.sample.temperature = 0.8
    c.sample.top_k = 0  # 0 = no top-k filtering

    if variant in (None, "", "default"):
        pass
    elif variant == "tiny":
        c.steps = 150
        c.batch_size = 16
        c.log_every = 10
        c.eval_every = 50
        c.eval_batches = 2
        c.model.block_size = 64
        c.model.n_layer = 2
        c.model.n_head = 2
        c.model.n_embd = 64
        c.optim.lr = 1e-2  # tiny model, few steps: a large rate gets the loss down fast
        c.optim.min_lr = 1e-3
        c.optim.warmup_steps = 10
        c.checkpoint.every = 50
        c.sample.max_new_tokens = 100
        c.eval.compile = False  # a smoke test: the small model scores eagerly in less than its compile takes
    elif variant == "gpt2":
        c.steps = 600_000
        c.batch_size = 480  # x 1024 tokens = ~0.5M tokens per step, as GPT-2
        c.accum_steps = 40  # 12 sequences per microbatch fit an 80 GB GPU in fp32
        c.log_every = 10
        c.eval_every = 1000
        c.eval_batches = 50
        c.model.vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64
        c.model.block_size = 1024
        c.model.n_layer = 12
        c.model.n_head = 12
        c.model.n_embd = 768
        c.loss_chunk_size = 1024  # 50k vocab: (12 x 1024) x 50304 fp32 logits would be 2.4 GB
        c.data.path = "data/openwebtext"  # nanoGPT's prepare.py output: train.bin / val.bin
        c.optim.lr = 6e-4
        c.optim.min_lr = 6e-5
        c.optim.warmup_steps = 2000
        c.checkpoint.every = 2000
    else:
        raise ValueError(f"unknown variant {variant!r}; use one of: default, tiny, gpt2")
    return c
