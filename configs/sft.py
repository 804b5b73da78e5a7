"""Fine-tuning a causal LM on supervised examples: prompts masked, the loss over every target token.

Command (from the repository root, no network: a tiny Qwen2 is written to the workdir, the examples
are the standard library's functions, "What does json.dumps(obj, ...) do?" -> the docstring's summary):

    python -m functrain.main --config=configs/sft.py

Expected result (2-core x86-64 with AVX-512, torch 2.13, fresh workdir, ~1.5-2 min wall): 4,056
stdlib functions become 3,503 train and 70 val conversations (85 longer than 257 bytes dropped),
218.9 steps per epoch of 16 padded rows (each batch as long as its longest conversation rounded up to
32, 64, 128 or 256 bytes: 66% of the rows' tokens real); the Qwen2ForCausalLM (0.46M params) compiles
in ~35 s, then 438 steps (2 epochs) at ~0.09 s/step; the loss per target byte (the assistant's text
and its `<|im_end|>`) 2.19 at step 50 -> 1.47 at 438, val 2.01 at step 100 -> 1.56 at 438 (as with rows
of the whole block: padding changes no number). The held-out prompt "What does
asyncio.base_events.BaseEventLoop.create_future(self) do?" gets a docstring-like answer that starts
"Return the ..." and repeats itself (a 0.46M-parameter model trained from scratch for 90 s; start from
a trained directory for real answers); the expected one is printed beside it. The run ends by writing `runs/sft/hf`.

Your own data and model: `--config.data.path=sft.jsonl` (records of prompt/completion, messages,
or instruction/input/output; `--config.data.fields` maps other names) and `--config.model.path=DIR`
(any transformers causal LM directory, e.g. the main job's export `runs/hf/hf` after
`configs/hf.py`, or functrain's gpt/llama exports); its tokenizer.json and chat template are used.
`--config.data.packing=True` packs whole examples into each row (attention stays within each);
`--config.data.train_on=all` learns the prompts too; `--config.epochs=N` sets the length in epochs.

LoRA (docs/guide.md "LoRA"): `--config.lora.rank=8` trains rank-8 adapters on every linear layer but
the head over the directory's frozen weights, and writes `<workdir>/hf` (merged) and `<workdir>/hf-peft`
(PEFT's adapter directory). Over the hf default run's export (`configs/hf.py`, then
`--config.model.path=runs/hf/hf --config.lora.rank=8`; same machine, ~2:45 wall): 38,912 of 498,816
params trained (7.8%), val 1.71 at step 100 -> 1.51 at 438 (the full fine-tune of the same directory:
1.59 -> 1.21), 0.17 s/step against the full fine-tune's 0.13 (a 0.46M model: the adapters' small
matmuls cost more than the frozen weights' gradients save; docs/results.md "LoRA").
"""

import ml_collections

from functrain.trainer import defaults


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    """The default fine-tuning run (the module docstring)."""
    c = defaults.trainer_config()
    c.epochs = 2.0  # over the training examples (steps follow from it)
    c.batch_size = 16
    c.log_every = 50
    c.eval_every = 100
    c.eval_batches = 4
    c.loss_chunk_size = 0
    c.remat = "auto"
    c.export_hf = True

    c.model = ml_collections.ConfigDict()
    c.model.name = "hf"
    c.model.path = "tiny:qwen2"  # a transformers model directory, or a tiny one of this type written to the workdir
    c.model.block_size = 256  # the longest example (tokens), and the row length
    c.model.weights = True

    c.data = defaults.data_config()
    c.data.path = "stdlib:messages"  # or "stdlib:prompt_completion", or your jsonl/parquet records
    c.data.tokenizer = "auto"  # the directory's tokenizer.json; bytes for a 256-id model
    c.data.val_fraction = 0.02
    c.data.packing = False

    c.optim.lr = 3e-3  # a tiny model from scratch; fine-tuning a trained one wants ~1e-5 to 1e-4
    c.optim.min_lr = 3e-4
    c.optim.warmup_steps = 30

    c.sample = ml_collections.ConfigDict()  # the answer to the first held-out prompt
    c.sample.prompt = ""
    c.sample.max_new_tokens = 120
    c.sample.temperature = 0.0  # greedy
    c.sample.top_k = 0

    if variant not in (None, "", "default"):
        raise ValueError(f"configs/sft.py has no variant {variant!r}; it has only the default")
    return c
