"""Preference objectives over chosen/rejected pairs (DPO and its common variants), as TRL's `DPOTrainer` defines
them: pure functions of the policy's and the reference's summed completion log-probabilities.

Internals: docs/internals.md "functrain.preference".

Example:
    >>> loss_fn = make_loss_fn(logits_fn, Preference("sigmoid", beta=0.1), reference=lambda p: reference_params)
    >>> loss, metrics = loss_fn(params, (x, y), key)    # x, y: (B, 2, T), pair i's chosen row [i, 0], rejected [i, 1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from functrain import metric_names as M

__all__ = [
    "LOSSES",
    "REFERENCE",
    "Preference",
    "adapters_off",
    "count_pairs",
    "frozen_reference",
    "is_reference",
    "make_loss_fn",
    "preference_loss",
    "reference_logps",
    "reference_of",
    "sequence_logps",
]

LOSSES = ("sigmoid", "ipo", "hinge")
"""The preference losses `Preference.loss` names."""

REFERENCE = "reference/"
"""The prefix of the reference's params among a state's frozen params (`frozen_reference`)."""


@dataclasses.dataclass(frozen=True)
class Preference:
    """A preference objective: which loss, its `beta`, and (sigmoid) its label smoothing.

    Attributes:
      loss: "sigmoid" (DPO: -log sigmoid(beta delta)), "ipo" ((delta / tokens - 1 / (2 beta))^2, each side's
        log-ratio divided by its completion's token count, as TRL does) or "hinge" (relu(1 - beta delta)), where
        delta = (log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected).
      beta: the temperature (IPO: its regularization tau), > 0.
      label_smoothing: sigmoid only: the probability that a pair's label is flipped (conservative DPO: the loss of
        the pair weighted 1 - e, of the swapped pair e); in [0, 0.5).

    Raises:
      ValueError: an unknown loss, beta <= 0, or a label smoothing outside [0, 0.5) or given to another loss.

    Example:
      >>> Preference("ipo", beta=0.5)
    """

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"preference loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if not self.beta > 0:
            raise ValueError(f"preference beta={self.beta} must be > 0")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing} must lie in [0, 0.5)")
        if self.label_smoothing and self.loss != "sigmoid":
            raise ValueError(f"label_smoothing is the sigmoid loss's; the {self.loss} loss takes none: set it to 0")


def sequence_logps(logits: torch.Tensor, y: torch.Tensor, ignore_index: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its targets, and their count (the completion's tokens).

    Args:
      logits: (N, T, V) next-token logits (any float dtype: the softmax runs in float32 or wider).
      y: (N, T) int64 targets; `ignore_index` where a position is not scored (prompt, padding).
      ignore_index: the value of unscored targets.

    Returns:
      `(logps, counts)`, (N,) each: sum over scored t of log softmax(logits[n, t])[y[n, t]], and the count of
      scored targets (float32).

    Example:
      >>> logps, counts = sequence_logps(model(x), y)    # x, y: (2B, T), the pairs' two rows each
    """
    scored = y != ignore_index  # (N, T)
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (N, T, V)
    picked = logp.gather(-1, torch.where(scored, y, 0).unsqueeze(-1)).squeeze(-1)  # (N, T)
    return torch.where(scored, picked, 0.0).sum(-1), scored.sum(-1).to(picked.dtype)


def preference_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    counts: torch.Tensor,
    how: Preference,
    real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each pair's preference loss, and TRL's metrics over the pairs.

    Args:
      logps: (B, 2) the policy's summed completion log-probs, [:, 0] the chosen, [:, 1] the rejected completion.
      ref_logps: (B, 2) the reference's (no gradient flows into them).
      counts: (B, 2) each completion's token count (IPO's per-token normalization).
      how: the `Preference`.
      real: (B,) bool, the pairs the metrics average over (None: all; a validation batch's filler pairs are not).

    Returns:
      `(losses, metrics)`: losses (B,); metrics 0-d tensors (means over the pairs, no gradient), named as TRL names
      them: rewards/chosen and rewards/rejected (beta times each side's log-ratio), rewards/accuracies (the share
      of pairs whose chosen reward is the larger), rewards/margins, logps/chosen and logps/rejected.

    Example:
      >>> losses, metrics = preference_loss(logps, ref_logps, counts, Preference("hinge", beta=0.2))
    """
    ratios = logps - ref_logps.detach()  # (B, 2): log pi / pi_ref of each side
    delta = ratios[:, 0] - ratios[:, 1]  # (B,)
    beta, e = how.beta, how.label_smoothing
    if how.loss == "sigmoid":
        losses = -(1 - e) * F.logsigmoid(beta * delta) - e * F.logsigmoid(-beta * delta)
    elif how.loss == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:  # ipo: each side's log-ratio per completion token
        per_token = ratios / counts.clamp(min=1.0)  # (B, 2)
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    rewards = beta * ratios.detach()  # (B, 2)
    w = torch.ones_like(delta) if real is None else real.to(delta.dtype)  # (B,)

    def mean(v: torch.Tensor) -> torch.Tensor:
        """The mean of (B,) `v` over the real pairs."""
        return (v * w).sum() / w.sum().clamp(min=1)

    metrics = {
        M.REWARDS_CHOSEN: mean(rewards[:, 0]),
        M.REWARDS_REJECTED: mean(rewards[:, 1]),
        M.REWARDS_ACCURACIES: mean((rewards[:, 0] > rewards[:, 1]).to(rewards.dtype)),
        M.REWARDS_MARGINS: mean(rewards[:, 0] - rewards[:, 1]),
        M.LOGPS_CHOSEN: mean(logps[:, 0].detach()),
        M.LOGPS_REJECTED: mean(logps[:, 1].detach()),
    }
    return losses, metrics


def make_loss_fn(
    logits_fn: Callable, how: Preference, *, reference: Callable[[dict], dict] | None, ignore_index: int = -1
) -> Callable:
    """`loss_fn(params, batch, key) -> (loss, metrics)`: the mean preference loss over a batch of pairs.

    A batch is `(x, y)` or, with the reference's log-probs computed beforehand, `(x, y, ref_logps)`: x and y
    (B, 2, T) int64, pair i's chosen row at [i, 0] and its rejected row at [i, 1] (so splitting the batch into
    microbatches never parts a pair), y the next-token targets, `ignore_index` where a target is not the
    completion's; ref_logps (B, 2). Every pair with a completion counts (`count_pairs` is the step's count); a pair
    of empty rows (a validation batch's filler) does not.

    Args:
      logits_fn: `(params, x, key) -> logits` (N, T, V) of the model on rows x (N, T).
      how: the `Preference`.
      reference: `params -> the reference's params`, run without gradient and without dropout: `reference_of`
        (the frozen copy `frozen_reference` put beside the params), `adapters_off` (a LoRA run's base: no second
        copy), or a function of your own; None: the batch carries `ref_logps` (`reference_logps`, computed
        beforehand). The policy runs on the params whose names do not start with `REFERENCE`.
      ignore_index: the value of unscored targets.

    Returns:
      The loss function; its metrics are `preference_loss`'s.

    Example:
      >>> loss_fn = make_loss_fn(lambda p, x, key: functional.apply(model, p, x), Preference(), reference=None)
      >>> loss, metrics = loss_fn(params, (x, y, ref_logps), None)
    """

    def loss_fn(params, batch, key):
        """(mean loss over the pairs of batch = (x, y[, ref_logps]), metrics)."""
        x, y = batch[0].flatten(0, 1), batch[1].flatten(0, 1)  # (B, 2, T) -> (2B, T): chosen, rejected, chosen, ...
        policy = {n: t for n, t in params.items() if not is_reference(n)}
        logps, counts = sequence_logps(logits_fn(policy, x, key), y, ignore_index)  # (2B,) each
        if reference is None:
            ref = batch[2].reshape(-1)  # (B, 2) -> (2B,)
        else:
            ref = reference_logps(logits_fn, reference(params), batch, ignore_index).reshape(-1)  # (2B,)
        real = counts.view(-1, 2)[:, 0] > 0  # (B,)
        losses, metrics = preference_loss(logps.view(-1, 2), ref.view(-1, 2), counts.view(-1, 2), how, real)
        return (losses * real).sum() / real.sum().clamp(min=1), metrics

    return loss_fn


def count_pairs(ignore_index: int = -1) -> Callable:
    """The pairs of a preference batch (`make_loss_fn`'s) as `make_train_step`'s `count_targets`: the step's loss
    is then the mean over every pair of the step, whatever the microbatches and data-parallel ranks.

    Args:
      ignore_index: the value of unscored targets (a pair whose chosen row has none is not counted).

    Returns:
      `count(batch) -> int64 0-d tensor`: the pairs of `batch[1]` (B, 2, T) with a completion.

    Example:
      >>> step = make_train_step(loss_fn, opt, accum_steps=4, count_targets=count_pairs())
    """

    def count(batch) -> torch.Tensor:
        """The pairs of `batch[1]` (B, 2, T) with a scored target."""
        return (batch[1][:, 0] != ignore_index).any(-1).sum()

    return count


def frozen_reference(params: dict) -> dict:
    """A copy of `params` as the reference, for `init_state(..., frozen=...)`: no gradient, no optimizer state,
    never written.

    Args:
      params: {name: tensor}, the starting params (a LoRA run: the base and the adapters).

    Returns:
      {`REFERENCE` + name: a detached copy}.

    Example:
      >>> state = init_state(params, optim.adamw(1e-6), frozen=frozen_reference(params))
      >>> loss_fn = make_loss_fn(logits_fn, Preference(), reference=reference_of)
    """
    return {REFERENCE + n: t.detach().clone() for n, t in params.items()}


def is_reference(name: str) -> bool:
    """Whether `name` is one of the reference copy's params (`frozen_reference`'s, under `REFERENCE`)."""
    return name.startswith(REFERENCE)


def reference_of(params: dict) -> dict:
    """The reference's params among a loss's params: a `make_loss_fn` reference.

    Args:
      params: the loss's params, `{**state.frozen, **state.params}`.

    Returns:
      The entries `frozen_reference` named, without their prefix.

    Example:
      >>> ref = reference_of({**state.frozen, **state.params})
    """
    return {n[len(REFERENCE) :]: t for n, t in params.items() if is_reference(n)}


def adapters_off(params: dict) -> dict:
    """A LoRA run's base as the reference: the adapters switched off, with no second copy of the base.

    Args:
      params: the loss's params (the frozen base and the adapters, `functrain.nn.lora`'s names).

    Returns:
      The same params with every `lora_B` zero: each adapted layer adds `B A x * scaling` = 0, so the outputs are
      the base model's, bit for bit.

    Example:
      >>> loss_fn = make_loss_fn(logits_fn, Preference(), reference=adapters_off)   # state.frozen: the base
    """
    off = {n: torch.zeros_like(t) for n, t in params.items() if n.endswith(".lora_B.weight")}
    return {n: t for n, t in params.items() if not is_reference(n)} | off


def reference_logps(logits_fn: Callable, params: dict, batch, ignore_index: int = -1) -> torch.Tensor:
    """The reference's summed completion log-probs of a batch of pairs (B, 2), without gradient or dropout: what
    `make_loss_fn` computes each step, or once beforehand (the batch's third entry then).

    Args:
      logits_fn: `(params, x, key) -> logits`, as `make_loss_fn`'s.
      params: the reference's params.
      batch: `(x, y, ...)` of pairs, x and y (B, 2, T).
      ignore_index: the value of unscored targets.

    Returns:
      (B, 2) float32 (or wider).

    Example:
      >>> batch = (x, y, reference_logps(logits_fn, start_params, (x, y)))
    """
    x, y = batch[0].flatten(0, 1), batch[1].flatten(0, 1)  # (B, 2, T) -> (2B, T)
    with torch.no_grad():
        logps, _ = sequence_logps(logits_fn(params, x, None), y, ignore_index)  # (2B,)
    return logps.view(-1, 2)
