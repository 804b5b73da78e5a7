"""Reinforcement learning from verifiable rewards (GRPO) of a causal LM on additions: each step samples 8
completions of each of 16 prompts ("17+25=") from the policy, scores them (the right sum; the share of digits,
the answer's form), normalizes the rewards within each prompt's group and takes a step of TRL's dapo loss.

Command (from the repository root, no network: a tiny Qwen2 is written to the workdir, the additions are made on
the fly):

    python -m functrain.main --config=configs/grpo.py

Expected result (2-core x86-64, torch 2.13, fresh workdir, ~3.5 min wall with a cold compile cache: the first step
compiles in ~150 s, then 0.3-0.5 s/step): the mean reward rises from ~0.02 (first 10 steps) to ~0.50 (last 30),
the answer's form (`rewards/formatted/mean`) from 0.05 to 1.00 and the completions shrink from 8 tokens (cut) to
~2; the sums are not learned by a fresh 0.46M model (`rewards/correct/mean` <= 0.004; the greedy answer to
"17+25=" is a digit), and from a model fine-tuned on them (`--config.model.path`, 16-18% right) they rise only
slowly (to ~20% in 100 steps at lr 1e-4; docs/results.md "Starting from a model fine-tuned on the sums").
tests/test_grpo_main.py asks the mean of the last 5 steps to exceed that of the first 5 by 0.3; docs/results.md
"Reinforcement learning from rewards: GRPO through the main job". Plot the reward: `python -m
functrain.trainer.plot runs/grpo`.

Your own prompts, rewards and model: `--config.data.path=prompts.jsonl` (records {prompt, ...}: a text or
messages, the other fields passed to the reward functions by name), `--config.grpo.rewards="('mymod:fn',)"`
(each `fn(prompts, completions, **fields) -> list[float | None]`, as TRL calls them) and
`--config.model.path=DIR` (e.g. the SFT job's export `runs/sft/hf`); docs/guide.md "Reinforcement learning from
rewards".
"""

import ml_collections

from functrain.trainer import defaults


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    """The default GRPO run (the module docstring)."""
    c = defaults.trainer_config()
    c.steps = 100
    c.batch_size = 16  # prompts per step (each sampled grpo.num_generations times)
    c.log_every = 10
    c.loss_chunk_size = 0
    c.remat = "auto"
    c.checkpoint.every = 50
    c.export_hf = True

    c.model = ml_collections.ConfigDict()
    c.model.name = "hf"
    c.model.path = "tiny:qwen2"  # a transformers model directory, or a tiny one of this type written to the workdir
    c.model.block_size = 16  # a prompt and its completion (tokens): the rows' length
    c.model.weights = True

    c.data = defaults.data_config()
    c.data.path = "additions"  # or your jsonl/parquet prompts
    c.data.tokenizer = "auto"  # the directory's tokenizer.json; bytes for a 256-id model

    c.grpo.rewards = ("functrain.data.additions:correct", "functrain.data.additions:formatted")
    c.grpo.reward_weights = (1.0, 0.5)
    c.grpo.num_generations = 8
    c.grpo.max_new_tokens = 8
    c.grpo.loss = "dapo"
    c.grpo.epsilon_high = 0.28

    c.optim.lr = 3e-3  # a tiny fresh model; a trained one wants ~1e-6
    c.optim.min_lr = 3e-4
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.0

    c.sample = ml_collections.ConfigDict()  # the answer to a prompt at the end
    c.sample.prompt = "17+25="
    c.sample.max_new_tokens = 8
    c.sample.temperature = 0.0  # greedy
    c.sample.top_k = 0

    if variant not in (None, "", "default"):
        raise ValueError(f"configs/grpo.py has no variant {variant!r}; it has only the default")
    return c
