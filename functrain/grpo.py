"""Group-relative policy optimization (GRPO) over sampled completions, as TRL's `GRPOTrainer` defines it:
group-normalized advantages of the completions' rewards, and the clipped surrogate losses (dapo, grpo, dr_grpo,
bnpo) with an optional k3 KL to a reference; a loss for `make_train_step`, as `functrain.preference`'s is.

Internals: docs/internals.md "functrain.grpo".

Example:
    >>> adv, stats = advantages(rewards, weights, group=8)           # rewards (N, F): N completions, F functions
    >>> loss_fn = make_loss_fn(logits_fn, GRPO("dapo", beta=0.04), reference=preference.reference_of)
    >>> step = make_train_step(loss_fn, opt, count_targets=count_for(GRPO("dapo")))
    >>> state, metrics = step(state, (x, y, adv, old_logps))        # x, y (B, T); adv (B,); old_logps (B, T)
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from functrain import metric_names as M
from functrain import preference
from functrain.errors import FunctrainError

__all__ = [
    "GRPO",
    "LOSSES",
    "SCALES",
    "RewardError",
    "advantages",
    "check_scale",
    "completion_rows",
    "count_for",
    "load_rewards",
    "make_loss_fn",
    "policy_loss",
    "score",
    "token_logps",
]

LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")
"""The losses `GRPO.loss` names: how the per-token losses are averaged (TRL's `loss_type`)."""

SCALES = ("group", "batch", "none")
"""What an advantage is divided by (TRL's `scale_rewards`): its group's reward std, the batch's, or nothing."""


@dataclasses.dataclass(frozen=True)
class GRPO:
    """A GRPO objective.

    Attributes:
      loss: how the per-token losses make the loss: "dapo" (their mean over every completion token of the step,
        over microbatches and ranks: `count_for`), "bnpo" (their mean over each microbatch's tokens, the
        microbatches weighted alike), "grpo" (each completion's token mean, then the mean over completions),
        "dr_grpo" (their sum over `max_completion_length` times the completions).
      beta: the weight of the k3 KL to the reference, exp(r - p) - (r - p) - 1 per token (0: no reference).
      epsilon: the ratio's clip below, 1 - epsilon.
      epsilon_high: the clip above, 1 + epsilon_high (None: epsilon).
      temperature: the sampling temperature the log-probs are taken at (the logits divided by it).
      max_completion_length: dr_grpo's constant normalizer.

    Example:
      >>> GRPO("dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28)
    """

    loss: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    temperature: float = 1.0
    max_completion_length: int = 256

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"grpo.loss={self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.beta < 0:
            raise ValueError(f"grpo.beta={self.beta} is negative; give 0 (no reference) or more")
        high = self.high
        if not (0 < self.epsilon < 1) or high <= 0:
            raise ValueError(
                f"grpo.epsilon={self.epsilon}, epsilon_high={high}: give 0 < epsilon < 1, epsilon_high > 0"
            )
        if self.temperature <= 0 or self.max_completion_length < 1:
            raise ValueError(
                f"grpo.temperature={self.temperature}, max_completion_length={self.max_completion_length}: give a "
                "temperature > 0 and a length >= 1"
            )

    @property
    def high(self) -> float:
        """The clip above: `epsilon_high`, else `epsilon`."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The std of x's non-NaN values (Bessel-corrected; NaN where fewer than 2)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    n = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * torch.where(n > 1, n / (n - 1), torch.nan)
    return var.sqrt().reshape(()) if dim is None else var.sqrt().squeeze(dim)


def check_scale(group: int, scale: str) -> None:
    """Refuses (one line) a `scale` that is not one of `SCALES`, or group scaling of groups under 2 completions.

    Args:
      group: completions per prompt (G).
      scale: what the advantages are divided by (`advantages`).

    Returns:
      None.

    Raises:
      ValueError: the line naming what to change.

    Example:
      >>> check_scale(8, "group")
    """
    if scale not in SCALES:
        raise ValueError(f"scale_rewards={scale!r} is not one of {', '.join(SCALES)}")
    if group < 2 and scale == "group":
        raise ValueError(
            f"{group} completion per prompt: a group's reward std needs 2 or more; sample more (num_generations) "
            "or scale by the batch's (scale_rewards=batch)"
        )


def advantages(
    rewards: torch.Tensor, weights: torch.Tensor, group: int, scale: str = "group"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each completion's advantage: its weighted reward minus its group's mean, divided by the reward std
    (`scale`), as TRL's `GRPOTrainer` computes them (`multi_objective_aggregation="sum_then_normalize"`).

    Args:
      rewards: (N, F) float, completion n's reward from function f; NaN where the function returned None (skipped:
        the weighted sum leaves it out; a completion no function scored gets advantage 0 and stays out of its
        group's mean and std). N = prompts x `group`, a prompt's completions adjacent.
      weights: (F,) each function's weight.
      group: completions per prompt (G).
      scale: one of `SCALES`.

    Returns:
      `(advantages (N,), stats)`: stats hold "reward" and "reward_std" (over the scored completions) and
      "frac_reward_zero_std" (the share of completions whose group, or batch, has rewards all alike), 0-d tensors.

    Example:
      >>> adv, stats = advantages(torch.tensor([[1.0], [0.0], [1.0], [1.0]]), torch.ones(1), group=2)
    """
    check_scale(group, scale)
    unscored = torch.isnan(rewards).all(dim=1)  # (N,)
    total = (rewards * weights[None]).nansum(dim=1).masked_fill(unscored, torch.nan)  # (N,)
    grouped = total.view(-1, group)  # (N / G, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)  # (N,)
    if scale == "batch":
        std = (_nanstd(total) if total.numel() > 1 else torch.zeros(())).expand_as(total)
    else:  # (none: the std only says which groups are all alike)
        std = _nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(total)
    adv = total - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    stats = {
        "reward": torch.nanmean(total),
        "reward_std": _nanstd(total),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean(),
    }
    return torch.nan_to_num(adv, nan=0.0), stats


def token_logps(
    logits: torch.Tensor, y: torch.Tensor, temperature: float = 1.0, ignore_index: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each scored target's log-probability at `temperature`, and the entropy of each position's distribution.

    Args:
      logits: (N, T, V) next-token logits (any float dtype: the softmax runs in float32 or wider).
      y: (N, T) int64 targets; `ignore_index` where a position is not scored (prompt, padding).
      temperature: the logits are divided by it (the temperature the completions were sampled at).
      ignore_index: the value of unscored targets.

    Returns:
      `(logps, entropy)`, (N, T) each: log softmax(logits / temperature)[y] (0 where unscored), and the
      distribution's entropy (no gradient).

    Example:
      >>> logps, entropy = token_logps(model(x), y, temperature=0.9)
    """
    scored = y != ignore_index  # (N, T)
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    picked = logp.gather(-1, torch.where(scored, y, 0).unsqueeze(-1)).squeeze(-1)  # (N, T, V) -> (N, T)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # (N, T)
    return torch.where(scored, picked, 0.0), entropy


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    how: GRPO,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a microbatch of completions (`how.loss`'s average of the clipped surrogate, plus beta times the
    k3 KL), and TRL's metrics over its completion tokens.

    Args:
      logps: (B, T) the policy's log-probs of the sampled tokens (0 where `mask` is 0).
      old_logps: (B, T) the sampling policy's (no gradient flows into them).
      ref_logps: (B, T) the reference's, or None (with `how.beta` 0).
      adv: (B,) each completion's advantage.
      mask: (B, T) bool, the completion tokens.
      how: the `GRPO`.

    Returns:
      `(loss, metrics)`: metrics 0-d tensors, means over the completion tokens: clip_ratio/low_mean,
      clip_ratio/high_mean, clip_ratio/region_mean, and kl (with a reference).

    Example:
      >>> loss, metrics = policy_loss(logps, old_logps, None, adv, y != -1, GRPO("grpo"))
    """
    m = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps.detach())  # (B, T)
    a = adv[:, None]  # (B,) -> (B, 1)
    clipped = torch.clamp(ratio, 1 - how.epsilon, 1 + how.high)
    per_token = -torch.min(ratio * a, clipped * a)  # (B, T)

    def mean(v: torch.Tensor) -> torch.Tensor:
        """The mean of (B, T) `v` over the completion tokens."""
        return (v * m).sum() / m.sum().clamp(min=1.0)

    metrics = {}
    if how.beta != 0:
        if ref_logps is None:
            raise ValueError("grpo.beta > 0 needs the reference's log-probs: give make_loss_fn a reference")
        diff = ref_logps.detach() - logps
        kl = torch.exp(diff) - diff - 1  # (B, T)
        per_token = per_token + how.beta * kl
        metrics[M.KL] = mean(kl.detach())
    low, high = (ratio < 1 - how.epsilon) & (a < 0), (ratio > 1 + how.high) & (a > 0)
    metrics[M.CLIP_LOW] = mean(low.to(m.dtype))
    metrics[M.CLIP_HIGH] = mean(high.to(m.dtype))
    metrics[M.CLIP_REGION] = mean((low | high).to(m.dtype))
    masked = per_token * m
    if how.loss in ("dapo", "bnpo"):
        loss = masked.sum() / m.sum().clamp(min=1.0)
    elif how.loss == "grpo":
        loss = (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    else:  # dr_grpo
        loss = masked.sum() / (per_token.shape[0] * how.max_completion_length)
    return loss, metrics


def make_loss_fn(
    logits_fn: Callable, how: GRPO, *, reference: Callable[[dict], dict] | None = None, ignore_index: int = -1
) -> Callable:
    """`loss_fn(params, batch, key) -> (loss, metrics)`: the GRPO loss of a microbatch of sampled completions.

    A batch is `(x, y, adv)`, `(x, y, adv, old_logps)` or `(x, y, adv, old_logps, ref_logps)`: x (B, T) int64 a
    prompt and its completion per row, y (B, T) the next tokens, `ignore_index` but over the completion; adv (B,)
    the advantages (`advantages`); old_logps (B, T) the sampling policy's log-probs of y (absent or None: the
    policy's own, detached, as TRL takes them when each batch of rollouts makes one step); ref_logps (B, T) the
    reference's, computed beforehand (with `how.beta` > 0 and no `reference`).

    Args:
      logits_fn: `(params, x, key) -> logits` (B, T, V) of the model on rows x.
      how: the `GRPO`.
      reference: `params -> the reference's params` (`preference.reference_of`, `preference.adapters_off`), run
        without gradient; None: the batch carries ref_logps where `how.beta` > 0. The policy runs on the params
        that are not the reference copy's (`preference.is_reference`).
      ignore_index: the value of unscored targets.

    Returns:
      The loss function; its metrics are `policy_loss`'s and the entropy (mean over the completion tokens).

    Example:
      >>> loss_fn = make_loss_fn(lambda p, x, key: functional.apply(model, p, x), GRPO("dapo"))
      >>> loss, metrics = loss_fn(params, (x, y, adv), None)
    """

    def loss_fn(params, batch, key):
        """(the loss of batch = (x, y, adv[, old_logps[, ref_logps]]), metrics)."""
        x, y, adv = batch[0], batch[1], batch[2]
        policy = {n: t for n, t in params.items() if not preference.is_reference(n)}
        logps, entropy = token_logps(logits_fn(policy, x, key), y, how.temperature, ignore_index)  # (B, T) each
        old = batch[3] if len(batch) > 3 and batch[3] is not None else logps.detach()
        ref = batch[4] if len(batch) > 4 else None
        if reference is not None and how.beta != 0:
            with torch.no_grad():
                ref_logits = logits_fn(reference(params), x, None)
                ref = token_logps(ref_logits, y, how.temperature, ignore_index)[0]
        mask = y != ignore_index
        loss, metrics = policy_loss(logps, old, ref, adv, mask, how)
        metrics[M.ENTROPY] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        return loss, metrics

    return loss_fn


def count_for(how: GRPO, ignore_index: int = -1) -> Callable:
    """`make_train_step`'s `count_targets` for `how.loss`: the weight of each microbatch's loss in the step's.

    "dapo": the completion tokens (the step's loss is then their mean over every microbatch and rank); "grpo" and
    "dr_grpo": the completions; "bnpo": 1 (each microbatch alike), as TRL's normalizers weigh them.

    Args:
      how: the `GRPO`.
      ignore_index: the value of unscored targets.

    Returns:
      `count(batch) -> int64 0-d tensor`.

    Example:
      >>> step = make_train_step(loss_fn, opt, accum_steps=4, count_targets=count_for(GRPO("dapo")))
    """

    def count(batch) -> torch.Tensor:
        """The weight of `batch` (x, y, adv, ...) in the step's loss."""
        y = batch[1]
        if how.loss == "dapo":
            return (y != ignore_index).sum()
        if how.loss == "bnpo":
            return torch.ones((), dtype=torch.int64, device=y.device)
        return torch.full((), y.shape[0], dtype=torch.int64, device=y.device)

    return count


def completion_rows(
    prompts: Sequence[Sequence[int]],
    samples: Sequence[Sequence[Any]],
    length: int,
    *,
    pad_id: int = 0,
    mask_truncated: bool = False,
    ignore_index: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `make_loss_fn` reads of each prompt's sampled completions: x the prompt then the completion, y the
    completion's tokens as the next-token targets (`ignore_index` elsewhere), right-padded to `length`.

    Args:
      prompts: each prompt's token ids.
      samples: each prompt's completions (`functrain.generation.Completion`s: `.tokens`, `.finish_reason`), as the
        `Generator` returns them with `n` samples per prompt; a prompt's completions become adjacent rows.
      length: the row length (a fixed one keeps a compiled step to one graph).
      pad_id: the id x is padded with.
      mask_truncated: a completion cut at `max_new_tokens` (finish reason "length") scores no token (TRL's
        `mask_truncated_completions`).
      ignore_index: the value of unscored targets.

    Returns:
      `(x, y)`, (N, length) int64 each, N the number of completions.

    Raises:
      ValueError: a prompt and completion longer than `length` (one line).

    Example:
      >>> samples = generator(params, prompts, 64, key=key, sampling=Sampling(0.9), n=8)
      >>> x, y = completion_rows(prompts, samples, 128)
    """
    n = sum(len(group) for group in samples)
    x = torch.full((n, length), pad_id, dtype=torch.int64)
    y = torch.full((n, length), ignore_index, dtype=torch.int64)
    row = 0
    for prompt, group in zip(prompts, samples, strict=True):
        for c in group:
            tokens = [*prompt, *c.tokens]
            if len(tokens) > length:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens and its completion of {len(c.tokens)} make {len(tokens)}, more "
                    f"than the rows' {length}; give longer rows or fewer new tokens"
                )
            x[row, : len(tokens)] = torch.tensor(tokens)
            if c.tokens and not (mask_truncated and c.finish_reason == "length"):
                y[row, len(prompt) - 1 : len(tokens) - 1] = torch.tensor(c.tokens)  # position t predicts token t + 1
            row += 1
    return x, y


class RewardError(FunctrainError, ValueError):
    """A reward function that cannot be imported, raises, or returns the wrong number of rewards (one line)."""


def load_rewards(specs: Sequence[str]) -> list[Callable]:
    """The reward functions `specs` name, each "module:function" (the module importable from the working directory
    or the Python path).

    Args:
      specs: e.g. ["rewards.math:correct", "rewards.math:formatted"].

    Returns:
      The functions, in order; each `f(prompts, completions, **fields) -> list[float | None]`, as TRL calls them.

    Raises:
      RewardError: a spec without ":", a module that does not import, a name it does not define or that is not
        callable (one line).

    Example:
      >>> correct, formatted = load_rewards(["rewards.math:correct", "rewards.math:formatted"])
    """
    out = []
    for spec in specs:
        module_name, _, name = spec.partition(":")
        if not module_name or not name:
            raise RewardError(f"reward {spec!r} is not 'module:function'; give e.g. 'rewards.math:correct'")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # (any failure to import: the user's module, one line)
            raise RewardError(
                f"reward {spec!r}: module {module_name!r} does not import ({type(exc).__name__}: {_first_line(exc)}); "
                "put it on the Python path (the working directory is) or fix it"
            ) from None
        fn = getattr(module, name, None)
        if not callable(fn):
            raise RewardError(f"reward {spec!r}: {module_name} has no function {name!r}; name one it defines")
        out.append(fn)
    return out


def score(
    functions: Sequence[Callable], prompts: Sequence[Any], completions: Sequence[Any], fields: dict[str, list]
) -> torch.Tensor:
    """Every completion's reward from each function, as TRL's `GRPOTrainer` asks for them.

    Args:
      functions: the reward functions (`load_rewards`), each called once with every completion.
      prompts: each completion's prompt (a prompt repeated for each of its completions).
      completions: the completions (text, or message lists).
      fields: each record's other fields, one value per completion (the functions get them as keyword arguments).

    Returns:
      (N, F) float32: completion n's reward from function f; NaN where the function returned None (not scored).

    Raises:
      RewardError: a function that raises (naming it and the first completion it was given), or returns other than
        one number or None per completion (one line).

    Example:
      >>> rewards = score([correct], ["17+25="] * 2, ["42", "41"], {"answer": [42, 42]})   # [[1.0], [0.0]]
    """
    columns = []
    for fn in functions:
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            values = fn(list(prompts), list(completions), **fields)
        except Exception as exc:  # (the user's function: one line naming it and the completion)
            where = _culprit(fn, prompts, completions, fields)
            raise RewardError(
                f"reward function {name} raised {type(exc).__name__}: {_first_line(exc)} ({where}); fix it, or return "
                "None for a completion it cannot score"
            ) from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(
                f"reward function {name} returned {got} values for {len(completions)} completions; return a list "
                "of one number (or None) per completion"
            )
        column = []
        for i, v in enumerate(values):
            if v is not None and not isinstance(v, numbers.Real):
                raise RewardError(
                    f"reward function {name} returned {v!r} for completion {i}; return a number or None per completion"
                )
            column.append(math.nan if v is None else float(v))
        columns.append(column)
    return torch.tensor(columns, dtype=torch.float32).T.reshape(len(completions), len(functions))


def _culprit(fn: Callable, prompts: Sequence[Any], completions: Sequence[Any], fields: dict[str, list]) -> str:
    """Which completion makes `fn` raise, found by calling it on each alone: "on completion i", or "on the batch"."""
    for i in range(len(completions)):
        try:
            fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in fields.items()})
        except Exception:  # (the first completion it fails on)
            return f"on completion {i} of {len(completions)}, prompt {str(prompts[i])[:60]!r}"
    return f"on the batch of {len(completions)} completions, none alone"


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (a one-line error quotes no more)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
