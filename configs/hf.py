"""Any transformers causal LM (Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-2, ...) from a model directory.

Commands (from the repository root; the first writes a tiny Qwen2 directory, no network needed):

    python -m functrain.models.hf.tiny runs/qwen2-tiny --type qwen2
    python -m functrain.main --config=configs/hf.py --config.model.path=runs/qwen2-tiny

Expected result (2-core AMD EPYC, torch 2.13, fresh workdir, 1:10 wall): the stdlib is tokenized to
bytes (31.1M train tokens), the Qwen2ForCausalLM (0.46M params, 2 layers of width 128) compiles in
~33 s, then 300 steps of 16 x 128 tokens at ~0.062 s/step; train loss ~5.5 -> 2.05 (2.63 at step 50),
val 2.45 at step 100 and 1.97 at step 300; the sample is Python-like bytes. The run ends by writing
`runs/hf/hf`, which `transformers.AutoModelForCausalLM.from_pretrained` loads.

The directory holds `config.json`, and optionally `*.safetensors` (loaded unless
`--config.model.weights=False`) and `tokenizer.json` (used with `data.tokenizer="auto"`; a directory
without one whose model has 256 ids trains on bytes; others need `--config.data.tokenizer`). Without
weights the model is initialized from the run's key as transformers' own init does it.
At the end the run writes `<workdir>/hf`, a directory `AutoModelForCausalLM.from_pretrained` loads.
LoRA over the directory's frozen weights: `--config.lora.rank=8 [--config.lora.targets='q_proj|v_proj']`
(the end writes `<workdir>/hf`, merged, and `<workdir>/hf-peft`, PEFT's adapter directory; docs/guide.md "LoRA").
The compile unit stays "step" by measurement (the loss's forward one graph with its backward, as
torch.compile(model) compiles a module; the update after it). `--config.optim.fused=True` (torch's fused
AdamW kernel after the compiled loss: no update graph) compiles Llama, Qwen2 and GPT-2 cold in
torch.compile's time (0.90-1.08x; 1.29-1.40x with the compiled update, the default);
`--config.compile_unit=blocks` a little less (llama 0.97x) but steps up to ~4% slower (docs/results.md); a
restart loads the saved step either way (~3-4 s).
Multi-process (FSDP, a gather per decoder layer):
`torchrun --standalone --nproc_per_node=2 -m functrain.main --config=configs/hf.py --config.model.path=DIR`.
"""

import ml_collections

from functrain.trainer import defaults


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    """The default run (the module docstring)."""
    c = defaults.trainer_config()
    c.steps = 300
    c.batch_size = 16
    c.log_every = 50
    c.eval_every = 100
    c.eval_batches = 2
    c.loss_chunk_size = 0  # > 0 (staged runs): chunked cross-entropy through the head
    c.remat = "auto"  # none on one process, full on a mesh (a gather per decoder layer)
    c.export_hf = True  # write <workdir>/hf at the end

    c.model = ml_collections.ConfigDict()
    c.model.name = "hf"
    c.model.path = ""  # a transformers model directory (required)
    c.model.block_size = 128  # training sequence length (at most the model's positions)
    c.model.weights = True  # load the directory's *.safetensors when it has them

    c.data = defaults.data_config()
    c.data.path = "stdlib"
    c.data.tokenizer = "auto"  # the directory's tokenizer.json; bytes for a 256-id model

    c.optim.lr = 3e-3  # a tiny model from scratch; fine-tuning wants ~1e-5 to 1e-4
    c.optim.min_lr = 3e-4
    c.optim.warmup_steps = 30

    c.sample = ml_collections.ConfigDict()
    c.sample.prompt = "def "
    c.sample.max_new_tokens = 60
    c.sample.temperature = 0.8
    c.sample.top_k = 0

    if variant not in (None, "", "default"):
        raise ValueError(f"configs/hf.py has no variant {variant!r}; it has only the default")
    return c
