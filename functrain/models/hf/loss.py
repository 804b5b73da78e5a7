"""The loss of a transformers causal LM: next-token cross-entropy of its own logits, or, staged (remat,
per-block gathers, `compile_unit="blocks"`), through its stages (`model.stages`) and its head.

Example:
    >>> loss_fn = make_loss_fn(template)
    >>> loss, aux = loss_fn(params, (x, y), None)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from functrain import functional
from functrain.models import lm
from functrain.models import stages as stages_lib
from functrain.models.hf.model import HFModel, HFModelError, StagingError, head_name, stages
from functrain.models.hf.probe import check_stages

__all__ = ["make_loss_fn", "run_loss"]


def make_loss_fn(
    model: HFModel,
    *,
    chunk_size: int = 0,
    ignore_index: int = -1,
    remat: str | int = "none",
    staged: bool = False,
    probe: HFModel | None = None,
) -> Callable:
    """`loss_fn(params, (x, y), key) -> (loss, {})` of a transformers causal LM.

    Args:
      model: `model.build_template`'s module.
      chunk_size: staged: > 0 chunks the cross-entropy through the head (the logits never whole).
      ignore_index: target value to ignore.
      remat: "none", "full" or N: recompute decoder layers in the backward.
      staged: stages even without remat (per-block gathers on sharded params).
      probe: the plain template `model` was made from (a tensor-parallel copy's), for `probe.check_stages`.

    Returns:
      The loss function. Unstaged it reads the model's own logits (`model(input_ids=x).logits`);
      staged, `hidden @ head.T` of its stages.

    Raises:
      StagingError: a staged loss of a model whose logits are more than `hidden @ head.T` (a head
        bias, logit soft-capping or scaling), or whose stages fail `probe.check_stages`, in one line
        (the unstaged loss, remat="none" and staged=False, trains it).

    Example:
      >>> loss_fn = make_loss_fn(template, remat="full")
    """
    if remat == "none" and not staged:

        def loss_fn(params, batch, key):
            """(cross-entropy of the model's logits of x against y, {}); a packed batch (x, y, positions) passes
            its positions as `position_ids`, from which transformers builds its block-causal masks."""
            x, y = batch[0], batch[1]
            extra = {"position_ids": batch[2]} if len(batch) > 2 else {}
            logits = functional.apply(model, params, input_ids=x, **extra).logits  # (B, T, V)
            return lm.cross_entropy(logits, y, ignore_index=ignore_index), {}

        return loss_fn
    config = model.config
    extra = [k for k in ("final_logit_softcapping", "logit_scale", "logits_scaling") if getattr(config, k, None)]
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        extra.append("a head bias")
    if extra:
        raise StagingError(
            f"{config.model_type}: its logits are more than hidden @ head.T ({', '.join(extra)}), which "
            "a staged loss computes"
        )
    st = stages(model, share=check_stages(probe or model))
    return lm.make_lm_loss_fn(
        model, st, head=head_name(model), chunk_size=chunk_size, ignore_index=ignore_index, remat=remat, staged=True
    )


def run_loss(config: Any, ctx: Any, model: HFModel, probe: HFModel) -> tuple[Callable, bool]:
    """A run's loss and whether it is staged: staged where the run asks for it (remat, a mesh, `compile_unit="blocks"`,
    pipeline stages); a model the family cannot stage trains unstaged (one note line) where the run only asked for
    stages by default (`remat=auto` on a mesh), and is refused in one line naming the flags to change where the run
    asked for them.

    Args:
      config: the run config (`remat`, `compile_unit`, `loss_chunk_size`).
      ctx: the parallel context.
      model: the model the loss runs (a tensor-parallel copy).
      probe: the plain template (the staging probe runs the base model's own forward).

    Returns:
      `(loss_fn, staged)`.

    Raises:
      HFModelError: stages asked for by a flag, of a model the family cannot stage.

    Example:
      >>> loss_fn, staged = run_loss(config, ctx, model, template)
    """
    remat, staged = stages_lib.resolve_remat(config.remat, ctx.mesh), stages_lib.wants_stages(config, ctx)
    try:
        loss_fn = make_loss_fn(model, chunk_size=config.loss_chunk_size, remat=remat, staged=staged, probe=probe)
        return loss_fn, staged or remat != "none"
    except StagingError as exc:
        asked = [
            flag
            for flag, on in (
                ("--config.remat=none", config.remat not in ("auto", "none")),
                ("--config.compile_unit=step", config.compile_unit == "blocks"),
                ("--config.mesh.pp=1", ctx.pp_world > 1),
            )
            if on
        ]
        if asked:
            raise HFModelError(f"{exc}; this family cannot stage it: train it with {' and '.join(asked)}") from None
        if ctx.is_main_process:
            print(
                f"functrain: note: {exc}; this family cannot stage it, so it trains unstaged: the whole model is "
                "gathered for each step",
                file=sys.stderr,
                flush=True,
            )
        return make_loss_fn(model, chunk_size=config.loss_chunk_size), False
