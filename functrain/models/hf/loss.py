"""The loss of a transformers causal LM: next-token cross-entropy of its own logits, or, staged (remat,
per-block gathers, `compile_unit="blocks"`), through its stages (`model.stages`) and its head.

Example:
    >>> loss_fn = make_loss_fn(template)
    >>> loss, aux = loss_fn(params, (x, y), None)
"""

from __future__ import annotations

from collections.abc import Callable

from functrain import functional
from functrain.models import lm
from functrain.models.hf.model import HFModel, StagingError, check_stages, head_name, stages

__all__ = ["make_loss_fn"]


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
      probe: the plain template `model` was made from (a tensor-parallel copy's), for `model.check_stages`.

    Returns:
      The loss function. Unstaged it reads the model's own logits (`model(input_ids=x).logits`);
      staged, `hidden @ head.T` of its stages.

    Raises:
      StagingError: a staged loss of a model whose logits are more than `hidden @ head.T` (a head
        bias, logit soft-capping or scaling), or whose stages fail `model.check_stages`, in one line
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
