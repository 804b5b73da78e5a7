"""Preference tuning in a language-model family (`--config.preference.*`, chosen/rejected pairs as data): the
preference loss over the family's logits, the pairs as the step's count, and the reference: a frozen copy of
the starting params beside them, or under LoRA the base with the adapters off (no second copy).

Internals: docs/internals.md "functrain.models.lm_preference".

Example:
    >>> how = lm_preference.objective_of(config, ctx, dataset)          # None: the token loss
    >>> loss_fn = lm_preference.loss_fn(how, logits_fn, lora_spec)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from functrain import config_checks, preference

__all__ = ["init_with_reference", "is_reference", "loss_fn", "objective_of"]


def objective_of(config: Any, ctx: Any, dataset: Any) -> preference.Preference | None:
    """The run's preference objective where its data are pairs (`data.format=preference`), else None.

    Args:
      config: the run config (`preference.*`, `mesh`, `checkpoint.init_from`, `lora.rank`).
      ctx: the parallel context.
      dataset: the run's data (`functrain.data.run_data`).

    Returns:
      The `preference.Preference`, or None.

    Raises:
      ConfigError: a mesh axis other than data parallelism, a full fine-tune from `checkpoint.init_from` (its
        reference would be the family's init, not the checkpoint), or a bad `preference.*` (one line each).

    Example:
      >>> how = objective_of(config, ctx, dataset)
    """
    if getattr(dataset, "info", {}).get("fmt") != "preference":
        return None
    split = [f"mesh.{a}={n}" for a, n in (("tp", ctx.tp_world), ("cp", ctx.cp_world), ("pp", ctx.pp_world)) if n > 1]
    if split:
        raise config_checks.ConfigError(
            f"preference pairs train on data-parallel meshes (fsdp, dp); {', '.join(split)} splits the model: set "
            "it to 1"
        )
    if config.checkpoint.init_from and not config.lora.rank:
        raise config_checks.ConfigError(
            "checkpoint.init_from with preference pairs: the frozen reference is a copy of the starting params as the "
            "family makes them; export the checkpoint (--export_hf) and start from its directory (--config.model.path)"
        )
    p = config.preference
    try:
        return preference.Preference(str(p.loss), float(p.beta), float(p.label_smoothing))
    except ValueError as exc:
        raise config_checks.ConfigError(f"{exc} (--config.preference.*)") from None


def loss_fn(how: preference.Preference, logits_fn: Callable, lora_on: bool) -> Callable:
    """`loss_fn(params, batch, key) -> (loss, metrics)`: `preference.make_loss_fn` over the family's logits, in eval
    mode (dropout off, as TRL's `disable_dropout`), its reference the frozen copy or (LoRA) the adapters off.

    Args:
      how: the `preference.Preference`.
      logits_fn: `(params, x) -> (N, T, V)` logits of the family's model in eval mode.
      lora_on: the run trains LoRA adapters (the reference: `preference.adapters_off`).

    Returns:
      The loss function over batches of pairs `(x, y)` (B, 2, T).

    Example:
      >>> loss = loss_fn(Preference("ipo", 0.5), lambda p, x: functional.apply(model, p, x, train=False), False)
    """
    reference = preference.adapters_off if lora_on else preference.reference_of
    return preference.make_loss_fn(lambda p, x, key: logits_fn(p, x), how, reference=reference)


def is_reference(name: str) -> bool:
    """Whether `name` is one of the reference copy's params (`init_with_reference`'s)."""
    return name.startswith(preference.REFERENCE)


def init_with_reference(init: Callable) -> Callable:
    """A family's `init_params(key, device, where=None)` followed by the reference: a copy of every param under
    `preference.REFERENCE` (`Task.frozen` holds it: no gradient, no optimizer state, recorded in the checkpoints by
    digest), each sharded as its original (on a mesh, the copy of this rank's block).

    Args:
      init: the family's init (with the adapters, where the run has them).

    Returns:
      `init_params(key, device, where=None)` of the params and their copies.

    Example:
      >>> init = init_with_reference(spec.init_params)
    """

    def init_params(key, device, where=None):
        shapes: dict = {}

        def noting(name, shape):
            shapes[name] = shape
            return where(name, shape)

        params = init(key, device, where=None if where is None else noting)
        if where is not None:
            for name in params:  # the copy's block: the same rules give it the same placements
                where(preference.REFERENCE + name, shapes[name])
        return params | {preference.REFERENCE + n: t.detach().clone() for n, t in params.items()}

    return init_params
