"""Preference tuning in a language-model family (`--config.preference.*`, chosen/rejected pairs as data): the
preference loss over the family's logits, the pairs as the step's count, and the reference: a frozen copy of
the starting params beside them, or under LoRA the base with the adapters off (no second copy).

Internals: docs/internals.md "functrain.models.lm_preference".

Example:
    >>> how = lm_preference.objective_of(config, ctx, dataset)          # None: the token loss
    >>> loss_fn = lm_preference.loss_fn(how, logits_fn, "copy")
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from functrain import checkpoint, config_checks, preference
from functrain.data.token_files import atomic_write

__all__ = ["data_parallel_only", "init_with_reference", "loss_fn", "objective_of", "with_reference_logps"]


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
    data_parallel_only(ctx, "preference pairs train")
    if config.checkpoint.init_from and (not config.lora.rank or config.preference.precompute_reference):
        raise config_checks.ConfigError(
            "checkpoint.init_from with preference pairs: the frozen reference is a copy of the starting params as the "
            "family makes them; export the checkpoint (--export_hf) and start from its directory (--config.model.path)"
        )
    p = config.preference
    if p.precompute_reference and str(config.precision) not in ("fp32", "float32"):
        raise config_checks.ConfigError(
            f"preference.precompute_reference=True with precision={config.precision}: a batch's floating entries are "
            "cast to the compute dtype, which would round the reference's log-probs; set precision=fp32 or "
            "precompute_reference=False (the reference then runs each step)"
        )
    try:
        return preference.Preference(str(p.loss), float(p.beta), float(p.label_smoothing))
    except ValueError as exc:
        raise config_checks.ConfigError(f"{exc} (--config.preference.*)") from None


def data_parallel_only(ctx: Any, what: str) -> None:
    """Raises `ConfigError` (one line starting with `what`) where `ctx`'s mesh splits the model (tp, cp, pp): an
    objective over whole sequences of a whole model's logits (pairs, rollouts) runs on data-parallel meshes.

    Example:
      >>> data_parallel_only(ctx, "GRPO trains")
    """
    split = [f"mesh.{a}={n}" for a, n in (("tp", ctx.tp_world), ("cp", ctx.cp_world), ("pp", ctx.pp_world)) if n > 1]
    if split:
        raise config_checks.ConfigError(
            f"{what} on data-parallel meshes (fsdp, dp); {', '.join(split)} splits the model: set it to 1"
        )


def loss_fn(how: preference.Preference, logits_fn: Callable, reference: str) -> Callable:
    """`loss_fn(params, batch, key) -> (loss, metrics)`: `preference.make_loss_fn` over the family's logits, in eval
    mode (dropout off, as TRL's `disable_dropout`).

    Args:
      how: the `preference.Preference`.
      logits_fn: `(params, x) -> (N, T, V)` logits of the family's model in eval mode.
      reference: "copy" (the frozen copy `init_with_reference` adds), "adapters_off" (a LoRA run's base) or
        "precomputed" (the batch's third entry: `with_reference_logps`).

    Returns:
      The loss function over batches of pairs `(x, y[, ref_logps])` (B, 2, T).

    Example:
      >>> loss = loss_fn(Preference("ipo", 0.5), lambda p, x: functional.apply(model, p, x, train=False), "copy")
    """
    ref = {"copy": preference.reference_of, "adapters_off": preference.adapters_off, "precomputed": None}[reference]
    return preference.make_loss_fn(lambda p, x, key: logits_fn(p, x), how, reference=ref)


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


def with_reference_logps(  # noqa: PLR0913
    dataset: Any, init: Callable, logits_fn: Callable, lora_on: bool, *, key, device, cache_dir, log: Callable
) -> Any:
    """`dataset` whose batches carry the reference's log-probs of their pairs (B, 2), computed once from the
    starting params (`preference.precompute_reference`): no reference runs during training and none is held.

    The log-probs of every training and validation pair are kept in `cache_dir`, named by a digest of the starting
    params and of the pairs' tokens: a resume (or another run from the same start) reads them.

    Args:
      dataset: the run's pairs (`functrain.data.SFTData` of the preference format).
      init: the family's `init_params(key, device)` (with the adapters, where the run has them).
      logits_fn: `(params, x) -> (N, T, V)` logits in eval mode.
      lora_on: the params are a LoRA run's (the reference: their base, the adapters off).
      key: the run's init key (`rng.key(config.seed)`).
      device: where the params are made and run.
      cache_dir: the run's data cache.
      log: where the line saying what was done goes.

    Returns:
      The dataset with its `reference` tables.

    Example:
      >>> data = with_reference_logps(data, init, logits, False, key=rng.key(0), device="cpu", cache_dir="runs/x/data",
      ...                             log=print)
    """
    params = init(key, device)  # (the whole starting model, once, on each process: freed when done)
    reference = preference.adapters_off(params) if lora_on else params
    path = Path(cache_dir) / f"reference-logps-{_digest(reference, dataset)}.npz"
    if path.exists():
        with np.load(path) as z:
            tables = {"train": z["train"], "val": z["val"]}
        log(f"reference: log-probs of every pair read from {path}")
    else:
        t0 = time.perf_counter()
        tables = {k: _logps(dataset, getattr(dataset, k), logits_fn, reference, device) for k in ("train", "val")}
        buf = io.BytesIO()
        np.savez(buf, **tables)
        if dataset.dp["rank"] == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: f.write(buf.getvalue()))
        pairs = sum(len(t) for t in tables.values())
        log(f"reference: log-probs of {pairs:,} pairs computed in {time.perf_counter() - t0:.1f}s, kept in {path}")
    del params, reference
    return dataclasses.replace(dataset, reference=tables)


def _logps(dataset: Any, examples: Any, logits_fn: Callable, params: dict, device) -> np.ndarray:
    """(pairs, 2) float32: the reference's summed completion log-probs of every pair of `examples`; under
    torch.distributed each rank computes every world-th chunk of `batch_size` pairs and the ranks share them."""
    s, n = dataset.sampler, len(examples) // 2
    rank, world = dataset.dp["rank"], dataset.dp["world"]
    mine = {}
    for start in range(rank * s.batch_size, n, world * s.batch_size):
        rows = [[i] for i in range(start, min(n, start + s.batch_size))]
        batch = s.tensors(examples, rows, s.row_length(rows, examples), device)
        logps = preference.reference_logps(lambda p, x, key: logits_fn(p, x), params, batch)  # (R, 2)
        mine[start] = logps.float().cpu().numpy()
    chunks: list = [mine]
    if world > 1:  # (every process: a run with pairs has no tp, cp or pp axis)
        chunks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(chunks, mine)
    every = {start: a for part in chunks for start, a in part.items()}
    return np.concatenate([every[k] for k in sorted(every)]) if every else np.zeros((0, 2), np.float32)


def _digest(params: dict, dataset: Any) -> str:
    """16 hex digits of sha256 over the params' digest (`checkpoint.digest`) and the pairs' tokens and targets."""
    h = hashlib.sha256(checkpoint.digest(params).encode())
    for examples in (dataset.train, dataset.val):
        for a in (examples.tokens, examples.targets, examples.offsets):
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]
