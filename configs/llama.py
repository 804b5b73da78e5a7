"""Llama-family decoder (RMSNorm, rotary, SwiGLU, grouped-query attention) with a byte-level BPE
trained on the Python standard library's sources (no network needed).

Command (from the repository root):

    python -m functrain.main --config=configs/llama.py:tiny

Expected result (tiny; 2-core AMD EPYC, torch 2.13, fresh workdir, 1:46-2:00 wall in all): the BPE
trains and the stdlib is tokenized once (~15 s: 12.0M train tokens, ~2.6 bytes per token), 25-40 s
of cold compilation, then 800 steps at 0.065-0.074 s/step (~30k tokens/s); train loss falls from
~6.9 (ln 1024, uniform) to 3.79, val 3.90 at step 800 (4.78 at step 200), and the sample looks like
Python (`def err, loc, vars():` / `def __exceptionsock__ import unittest.TestCase):`). Peak RSS
~0.95 GB.

Variants (`--config=configs/llama.py:<variant>`):
  (default) a 4-layer, 256-wide model (BPE of 2048 ids), 1000 steps of 32 x 128 tokens on CPU
            (not timed yet).
  tiny      CPU smoke test: 2 layers x 128, BPE of 1024 ids, 800 steps of 16 x 128 tokens.
  smollm    SmolLM-135M's shape (30 layers x 576, 9 query / 3 kv heads, tied head, 49152 ids) for a
            GPU, in bf16. With a local copy of the real model, fine-tune it instead:
            `--config.init_from=hf:/path/to/SmolLM-135M` (config, weights and tokenizer.json are
            read from there; `model.block_size` is the training length).
  1b        TinyLlama-1.1B's shape (22 layers x 2048, 32 query / 4 kv heads, 32000 ids, sequences of
            2048) in bf16 on bytes, for GPU throughput (`bash bench/gpu.sh llama1b`).

The tokenizer (`data.tokenizer`): "auto" uses the init_from directory's tokenizer.json (bytes when it
has none and its model has 256 ids; any other directory without one is refused up front), else
trains a byte-level BPE of `model.vocab_size` ids (2048 when 0) on the training split, once, saved in
`<workdir>/data/` and reused; "bytes", "bpe:N" or a path to a tokenizer.json also work. A BPE trains on
plain text: supervised records (prompt/completion, messages, preference pairs) take bytes or a tokenizer.json.

Hugging Face export: with `export_hf=True` (default) the run writes `<workdir>/hf` at the end
(config.json, model.safetensors, tokenizer.json) for `transformers.AutoModelForCausalLM`; any
checkpoint exports with
`python -m functrain.main --config=configs/llama.py:tiny --export_hf=out/
--export_from=runs/llama-tiny/checkpoints/100`.

LoRA over `init_from`'s frozen weights: `--config.init_from=hf:DIR --config.lora.rank=8` (merged export
and PEFT directory at the end; docs/guide.md "LoRA").
The compile unit stays "step" by measurement (the loss's forward one graph with its backward, as
torch.compile(model) compiles a module; the update after it). `--config.optim.fused=True` (torch's fused
AdamW kernel: no update graph) compiles the decoder families cold in torch.compile's time (0.90-1.08x;
1.29-1.40x with the compiled update, the default); `--config.compile_unit=blocks` a little less but steps
up to ~4% slower (docs/results.md).
Multi-process (FSDP, per-block gather): `torchrun --standalone --nproc_per_node=2 -m functrain.main
--config=configs/llama.py:tiny`; tensor parallel: add `--config.mesh.tp=2`.
"""

import ml_collections

from functrain.trainer import defaults


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    """The default run, or one of the variants named in the module docstring."""
    c = defaults.trainer_config()
    c.steps = 1000
    c.loss_chunk_size = 0  # > 0: chunked cross-entropy through the head; logits never whole
    c.remat = "auto"  # none on one process, full on a mesh (see configs/gpt.py)
    c.init_from = ""  # "hf:<dir>": model, weights and tokenizer from a local Hugging Face directory
    c.export_hf = True  # write <workdir>/hf (transformers-loadable) at the end

    c.model = ml_collections.ConfigDict()
    c.model.name = "llama"
    c.model.vocab_size = 0  # 0 = the tokenizer's
    c.model.block_size = 128  # training sequence length (and the model's limit when fresh)
    c.model.n_layer = 4
    c.model.n_head = 4
    c.model.n_kv_head = 2  # grouped-query attention: 2 query heads share each kv head
    c.model.n_embd = 256
    c.model.intermediate_size = 0  # 0 = 8/3 n_embd rounded up to a multiple of 64
    c.model.head_dim = 0  # 0 = n_embd / n_head
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = True  # small vocabularies: the head is most of the parameters otherwise
    c.model.dropout = 0.0

    c.data = defaults.data_config()  # path, cache_dir, text_field, sampling, sources, mixture, ...
    c.data.path = "stdlib"  # the Python standard library's sources: offline everywhere
    c.data.tokenizer = "auto"

    c.optim.lr = 2e-3  # small model with warm-up; SmolLM-sized models want ~3e-4
    c.optim.min_lr = 2e-4
    c.optim.b2 = 0.95
    c.optim.warmup_steps = 50

    c.sample = ml_collections.ConfigDict()
    c.sample.prompt = "def "
    c.sample.max_new_tokens = 100
    c.sample.temperature = 0.8
    c.sample.top_k = 0

    if variant in (None, "", "default"):
        pass
    elif variant == "tiny":
        c.steps = 800  # ~0.06 s/step on 2 CPU cores: under a minute of training
        c.batch_size = 16
        c.log_every = 50
        c.eval_every = 200
        c.eval_batches = 2
        c.model.vocab_size = 1024  # the BPE's size: trains in ~3 s, ~2.6 bytes per token
        c.model.block_size = 128
        c.model.n_layer = 2
        c.model.n_head = 4
        c.model.n_kv_head = 2
        c.model.n_embd = 128
        c.optim.lr = 1e-2  # tiny model, few steps: a large rate gets the loss down fast
        c.optim.min_lr = 1e-3
        c.optim.warmup_steps = 20
        c.checkpoint.every = 200
        c.sample.max_new_tokens = 40
    elif variant == "smollm":
        c.steps = 5000
        c.batch_size = 64
        c.log_every = 10
        c.eval_every = 500
        c.eval_batches = 20
        c.precision = "bf16"
        c.model.vocab_size = 49152  # SmolLM's; fresh runs train a BPE of this size on the data
        c.model.block_size = 2048
        c.model.n_layer = 30
        c.model.n_head = 9
        c.model.n_kv_head = 3
        c.model.n_embd = 576
        c.model.intermediate_size = 1536
        c.model.tie_embeddings = True
        c.loss_chunk_size = 4096  # 49k vocab: (64 x 2048) x 49152 logits would not fit
        c.optim.lr = 3e-4
        c.optim.min_lr = 3e-5
        c.optim.warmup_steps = 200
        c.checkpoint.every = 500
    elif variant == "1b":
        c.steps = 5000
        c.batch_size = 8
        c.log_every = 10
        c.eval_every = 500
        c.eval_batches = 10
        c.precision = "bf16"
        c.data.tokenizer = "bytes"  # a throughput shape: no 32k-id BPE to train first
        c.model.vocab_size = 32000  # TinyLlama-1.1B's shape (ids past the 256 bytes are never seen)
        c.model.block_size = 2048
        c.model.n_layer = 22
        c.model.n_head = 32
        c.model.n_kv_head = 4
        c.model.n_embd = 2048
        c.model.intermediate_size = 5632
        c.model.tie_embeddings = False
        c.loss_chunk_size = 4096  # (8 x 2048) x 32000 fp32 logits would be 2 GB
        c.optim.lr = 3e-4
        c.optim.min_lr = 3e-5
        c.optim.warmup_steps = 200
        c.checkpoint.every = 500
        c.sample.max_new_tokens = 0
    else:
        raise ValueError(f"unknown variant {variant!r}; use one of: default, tiny, smollm, 1b")
    return c
