"""Reinforcement learning from rewards in a language-model family (`--config.grpo.*`, prompts as data): each step's
batch is a rollout of the current policy (`Rollouts`, data the loop reads with the params), its loss
`functrain.grpo`'s.

Internals: docs/internals.md "functrain.models.lm_grpo".

Example:
    >>> how = lm_grpo.objective_of(config, ctx, dataset)               # None: not a prompts dataset
    >>> sampler = lm_grpo.Sampler.of(config, cached, dataset.tokenizer, ctx)
    >>> data = lm_grpo.Rollouts(dataset, sampler, lm_grpo.rewards_of(config), key=rng.key(0), workdir=w, device=d)
    >>> batch = data.train_batch(0, state.params)                     # (x, y, adv[, old_logps]) of this rank
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from functrain import config_checks, generation, grpo, parallel, rng
from functrain.data.supervised import example_end
from functrain.data.token_files import atomic_write
from functrain.models import lm_preference

__all__ = ["Rollouts", "Sampler", "objective_of", "rewards_of", "row_tokens"]


def objective_of(config: Any, ctx: Any, dataset: Any) -> grpo.GRPO | None:
    """The run's GRPO objective where its data are prompts (`data.format=prompts`), else None.

    Args:
      config: the run config (`grpo.*`, `mesh`).
      ctx: the parallel context.
      dataset: the run's data (`functrain.data.run_data`).

    Returns:
      The `grpo.GRPO`, or None.

    Raises:
      ConfigError: a mesh axis other than data parallelism, a bad `grpo.*` (one line each).

    Example:
      >>> how = objective_of(config, ctx, dataset)
    """
    if getattr(dataset, "info", {}).get("fmt") != "prompts":
        return None
    lm_preference.data_parallel_only(ctx, "GRPO trains")
    g = config.grpo
    try:
        grpo.check_scale(g.num_generations, g.scale_rewards)
        return grpo.GRPO(
            g.loss, beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high or None, temperature=g.temperature,
            max_completion_length=g.max_new_tokens,
        )  # fmt: skip
    except ValueError as exc:
        raise config_checks.ConfigError(str(exc)) from None


def rewards_of(config: Any) -> tuple[list[Callable], torch.Tensor]:
    """The reward functions `grpo.rewards` names and their weights (`grpo.reward_weights`, default 1 each).

    Raises:
      ConfigError: no reward function, or weights of another count (one line); RewardError: one that does not
        import.

    Example:
      >>> functions, weights = rewards_of(config)
    """
    specs, weights = list(config.grpo.rewards), [float(w) for w in config.grpo.reward_weights]
    if not specs:
        raise config_checks.ConfigError(
            "prompts as data train on rewards, and grpo.rewards names none; give 'module:function' names, e.g. "
            "--config.grpo.rewards=\"('functrain.data.additions:correct',)\""
        )
    functions = grpo.load_rewards(specs)
    if weights and len(weights) != len(specs):
        raise config_checks.ConfigError(
            f"grpo.reward_weights has {len(weights)} weights for {len(specs)} reward functions; give one each, or ()"
        )
    return functions, torch.tensor(weights or [1.0] * len(specs))


class Sampler(NamedTuple):
    """How a rollout samples: the generator, the completions per prompt, the new tokens, the draws, the stop ids.

    Attributes:
      generator: the family's `generation.Generator` (its block: the run's rows).
      group: completions per prompt (G, `grpo.num_generations`).
      max_new_tokens: the longest completion.
      sampling: temperature and top-k.
      eos_ids: the ids that end a completion (the tokenizer's end of text).
      mask_truncated: a completion cut at `max_new_tokens` scores no token.
      scale: `grpo.scale_rewards`.
      iterations: optimizer steps per rollout (`grpo.num_iterations`).
    """

    generator: generation.Generator
    group: int
    max_new_tokens: int
    sampling: generation.Sampling
    eos_ids: tuple[int, ...]
    mask_truncated: bool
    scale: str
    iterations: int

    @classmethod
    def of(cls, config: Any, cached: generation.CachedModel, tokenizer: Any, ctx: Any) -> Sampler:
        """The run's sampler over the family's cached model (`config.grpo`, rows of `model.block_size`): a batch of
        rows for every completion of the step, or where `ctx`'s mesh holds the whole model on each rank (no
        dp_shard) for the rank's share of them.

        Example:
          >>> Sampler.of(config, built.cached, dataset.tokenizer, ctx)
        """
        g = config.grpo
        prompts = config.batch_size // ctx.dp_world if ctx.shape.get("dp_shard", 1) == 1 else config.batch_size
        rows = prompts * g.num_generations  # every completion a rank samples, in one batch of rows
        gen = generation.Generator(
            cached, block_size=config.model.block_size, batch_size=rows, compile=bool(config.compile)
        )
        return cls(
            gen, g.num_generations, g.max_new_tokens, generation.Sampling(g.temperature, g.top_k or 0),
            tuple(example_end(tokenizer)), bool(g.mask_truncated), g.scale_rewards, g.num_iterations,
        )  # fmt: skip


def _whole_or_sharded(params: dict) -> tuple[dict, bool]:
    """(params, whether they are sharded): DTensors this rank holds whole (replicated: no dp_shard) as their local
    tensors, which decode alone, compiled."""
    if all(not parallel.is_dtensor(t) or t.to_local().shape == t.shape for t in params.values()):
        return {k: t.to_local() if parallel.is_dtensor(t) else t for k, t in params.items()}, False
    return params, True


class Rollouts:
    """A GRPO run's data: step s's batch is a rollout of the policy at step s - s % iterations (its prompts'
    completions sampled with the key `fold_in(key, step)`, scored and turned into advantages), read by the loop
    with the params (`on_policy`). With several steps per rollout, a rollout is kept in `<workdir>/rollouts` until
    its steps are taken: a run resumed between them reads it back.

    Args:
      prompts: the run's `functrain.data.PromptData`.
      sampler: the `Sampler`.
      rewards: the reward functions, and their weights.
      key: the run's sampling key.
      workdir: the run directory.
      device: where batches go.
    """

    on_policy = True

    def __init__(self, prompts: Any, sampler: Sampler, rewards: tuple[list[Callable], torch.Tensor], *, key, workdir,
                 device):  # fmt: skip
        self.prompts, self.sampler, self.key, self.device = prompts, sampler, key, device
        self.functions, self.weights = rewards
        self.info, self.tokenizer, self.encode, self.decode = (
            prompts.info,
            prompts.tokenizer,
            prompts.encode,
            prompts.decode,
        )
        self.dir = Path(workdir) / "rollouts"
        self._kept: tuple[int, tuple] | None = None  # (rollout step, batch)
        self._window: list[dict[str, float]] = []  # each rollout's metrics since the last `position`
        self._check_lengths()

    def _check_lengths(self) -> None:
        """One line for a prompt that leaves no room for `max_new_tokens` in the rows."""
        room = self.sampler.generator.block_size - self.sampler.max_new_tokens + 1
        for i, ids in enumerate(self.prompts.ids):
            if len(ids) > room:
                raise config_checks.ConfigError(
                    f"prompt {i} has {len(ids)} tokens: with grpo.max_new_tokens={self.sampler.max_new_tokens} it "
                    f"exceeds model.block_size={self.sampler.generator.block_size}; raise the block, ask for fewer "
                    "new tokens or shorten the prompt"
                )

    def train_batch(self, step: int, params: dict) -> tuple:
        """This rank's rows of `step`: `(x, y, adv)`, with `old_logps` when a rollout makes several steps.

        Args:
          step: the step (0-based).
          params: what the policy computes with now (`task.OnPolicy`: no reference copy among them), the rollout's
            when `step` starts one.

        Returns:
          The batch, on the device.
        """
        start = step - step % self.sampler.iterations
        if self._kept is not None and self._kept[0] == start:
            return self._kept[1]
        path = self.dir / f"{start}-{self.prompts.place.dp_rank}.pt"
        if step == start:
            batch = self._rollout(start, params)
            if self.sampler.iterations > 1:
                self._keep(path, batch)
        elif path.exists():
            batch = tuple(t.to(self.device) for t in torch.load(path, weights_only=True))
        else:
            raise config_checks.ConfigError(
                f"step {step + 1} trains on the rollout of step {start + 1}, which is not in {self.dir}; resume from a "
                f"checkpoint at a multiple of grpo.num_iterations={self.sampler.iterations}"
            )
        self._kept = (start, batch)
        return batch

    def _keep(self, path: Path, batch: tuple) -> None:
        """Writes the rollout to `path` (the older ones removed: a resume needs only the newest)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save([t.cpu() for t in batch], f))
        for old in self.dir.glob(f"*-{self.prompts.place.dp_rank}.pt"):
            if old != path:
                old.unlink(missing_ok=True)

    def _rollout(self, step: int, params: dict) -> tuple:
        """Samples, scores and weighs this rank's completions of `step`'s prompts."""
        s, share = self.sampler, self.prompts.prompts_at(step)
        params, sharded = _whole_or_sharded(params)
        # sharded params decode in step on every rank (each forward gathers): every rank samples the whole batch
        asked = self.prompts.prompts_at(step, whole=True) if sharded else share
        t0 = time.perf_counter()
        samples = s.generator(
            params, asked.ids, s.max_new_tokens, key=rng.fold_in(self.key, step), sampling=s.sampling, n=s.group,
            eos_ids=s.eos_ids, index=asked.places,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        old = self._old_logps(params, asked.ids, samples) if s.iterations > 1 else None
        mine_of = slice(share.places[0] - asked.places[0], share.places[0] - asked.places[0] + len(share.places))
        samples = samples[mine_of]  # this rank's prompts
        done = [c for group in samples for c in group]
        special = set(s.eos_ids) if getattr(self.tokenizer, "eos_id", None) is not None else set()  # (bytes: a text)
        texts = [self.decode([t for t in c.tokens if t not in special]) for c in done]  # as TRL decodes them
        each = [p for p in share.prompts for _ in range(s.group)]
        fields = {k: [v for v in values for _ in range(s.group)] for k, values in share.fields.items()}
        scores = grpo.score(self.functions, each, texts, fields)  # (N, F)
        lengths = torch.tensor([[len(c.tokens), c.finish_reason == "length"] for c in done], dtype=torch.float32)
        every, mine = _gathered(torch.cat([scores, lengths], 1), self.prompts.place.dp_world)  # (W N, F + 2)
        adv, stats = grpo.advantages(every[:, : scores.shape[1]], self.weights, s.group, s.scale)
        x, y = grpo.completion_rows(
            share.ids, samples, s.generator.block_size, mask_truncated=s.mask_truncated
        )  # (N, T) each
        batch: tuple = (x, y, adv[mine])
        if old is not None:  # each completion token's log-prob under the rollout's params, where y holds it
            rows = torch.zeros(x.shape, dtype=torch.float32)
            mine_rows = old[mine_of.start * s.group : mine_of.stop * s.group]
            for row, (ids, logps) in enumerate(zip([i for i in share.ids for _ in range(s.group)], mine_rows)):
                rows[row, len(ids) - 1 : len(ids) - 1 + len(logps)] = torch.tensor(logps)
            batch = (*batch, rows)
        self._window.append(
            self._metrics(every, scores.shape[1], adv, stats, sum(len(c.tokens) for c in done) / seconds)
        )
        return tuple(t.to(self.device) for t in batch)

    def _old_logps(self, params: dict, prompts: list, samples: list) -> list[list[float]]:
        """Each completion's token log-probs under `params` at the sampling temperature (TRL recomputes them so when
        a rollout makes several steps): a forward of every prompt + completion through the generator's cache."""
        s = self.sampler
        sequences = [list(ids) + c.tokens for ids, group in zip(prompts, samples) for c in group]
        scored = s.generator.score(params, sequences, temperature=s.sampling.temperature)
        return [lp[len(lp) - len(c.tokens) :] for lp, c in zip(scored, (c for group in samples for c in group))]

    def _metrics(self, every: torch.Tensor, functions: int, adv: torch.Tensor, stats: dict, rate: float) -> dict:
        """A rollout's metrics (TRL's names): rewards, advantages, completion lengths, sampling speed."""
        out = {k: float(v) for k, v in stats.items()}
        for f, fn in enumerate(self.functions):
            out[f"rewards/{fn.__name__}/mean"] = float(torch.nanmean(every[:, f]))
        lengths, cut = every[:, functions], every[:, functions + 1]
        out.update({
            "advantage/mean": float(adv.mean()), "advantage/std": float(adv.std()) if adv.numel() > 1 else 0.0,
            "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(cut.mean()),
            "rollout_tokens_per_s": rate,
        })  # fmt: skip
        return out

    def position(self, step: int) -> dict[str, float]:
        """The epoch, and the mean of each rollout metric over the rollouts since the last call."""
        out = self.prompts.position(step)
        if self._window:
            out.update({k: sum(m[k] for m in self._window) / len(self._window) for k in self._window[0]})
            self._window = []
        return out

    @property
    def steps_per_epoch(self) -> float:
        """Steps per pass over the prompts (a rollout's steps count once)."""
        return self.prompts.steps_per_epoch * self.sampler.iterations

    def eval_sets(self) -> list:
        """No held-out loss."""
        return []

    def record(self) -> dict:
        """The prompts' record (a resume on other prompts stops)."""
        return self.prompts.record()

    def validation_text(self) -> None:
        """No validation documents."""
        return None

    def describe(self) -> str:
        """E.g. '5,000 prompts (additions), 8 completions each of up to 12 tokens sampled in rows of 128, 625.0 steps
        per epoch' (the rows: every completion a rank samples in a step)."""
        s = self.sampler
        return (
            f"{len(self.prompts.ids):,} prompts ({self.info['source']}), {s.group} completions each of up to "
            f"{s.max_new_tokens} tokens sampled in rows of {s.generator.batch_size}, {self.steps_per_epoch:.1f} steps "
            "per epoch"
        )


def _gathered(mine: torch.Tensor, world: int) -> tuple[torch.Tensor, slice]:
    """Every data-parallel rank's rows of `mine` in rank order, and where this rank's are among them."""
    if world == 1:
        return mine, slice(0, mine.shape[0])
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    rank = torch.distributed.get_rank()
    return torch.cat(parts), slice(rank * mine.shape[0], (rank + 1) * mine.shape[0])


def row_tokens(config: Any) -> Callable[[Any], int]:
    """`tokens_per_step(batch)` of a GRPO run: every rank's rows of the step (prompts x completions x row length)."""
    rows = config.batch_size * config.grpo.num_generations
    return lambda batch: rows * batch[0][0].numel()
