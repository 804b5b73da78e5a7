"""A run's frozen params (`Task.frozen`, a LoRA base): split from the trained ones at the start, kept in
`TrainState.frozen`, left out of the checkpoints, which hold a record of them instead (where they came
from and a digest of their values), so a resume or an export over another base stops in one line.

Example:
    >>> trained, frozen = frozen_lib.split(task, params)
    >>> record = frozen_lib.record(state.frozen, source="runs/base/checkpoints/2500")
    >>> frozen_lib.check(saved_record, record, "runs/lora/checkpoints/40")
"""

from __future__ import annotations

from typing import Any

from functrain import checkpoint as ckpt_lib
from functrain import preference
from functrain import rng as rng_lib
from functrain.checkpoint import digests
from functrain.state import TrainState
from functrain.task import Task

__all__ = [
    "KEY",
    "FrozenMismatch",
    "base_for_export",
    "check",
    "merged",
    "record",
    "saved",
    "source_of",
    "split",
]

KEY = "frozen"
"""Where the record goes in a checkpoint's `custom_metadata["functrain"]`."""


class FrozenMismatch(ckpt_lib.CheckpointError):
    """A checkpoint trained over other frozen params than the run's (no other step of it can help)."""


def split(task: Task, params: dict) -> tuple[dict, dict]:
    """`(trained, frozen)`: `params` split by `task.frozen` (everything trains when it is None).

    Example:
      >>> trained, frozen = split(task, task.init_params(key, device))
    """
    if task.frozen is None:
        return params, {}
    frozen = {n: v for n, v in params.items() if task.frozen(n)}
    return {n: v for n, v in params.items() if n not in frozen}, frozen


def merged(state: TrainState) -> dict:
    """The frozen and the trained params together: what the model computes with (a preference run's reference copy,
    read by its loss alone, left out)."""
    if not state.frozen:
        return state.params
    return {n: t for n, t in state.frozen.items() if not preference.is_reference(n)} | state.params


def saved(state: TrainState) -> TrainState:
    """`state` as checkpoints hold it: without its frozen params (their record is in the metadata)."""
    return state.replace(frozen={}) if state.frozen else state


def source_of(config: Any) -> str:
    """Where the run's frozen params come from, in words: `checkpoint.init_from`, else the model directory
    (`model.path`, or the llama family's `init_from`), else the family's init from the run's seed."""
    init_from = config.checkpoint.init_from
    if init_from:
        return f"checkpoint {init_from}"
    path = config.get("model", {}).get("path", "") or config.get("init_from", "")
    return f"model {path}" if path else f"init from seed {config.seed}"


def base_for_export(
    task: Task, config: Any, step_dir: str, device, saved_record: dict | None, init_from: str | None
) -> dict:
    """The frozen params a LoRA checkpoint at `step_dir` was trained over, made again as its run made them
    (the family's init from the config's seed, or the committed checkpoint `init_from`), whole on this
    process, and checked against the checkpoint's record (`check`).

    Example:
      >>> base = base_for_export(task, config, "runs/lora/checkpoints/40", torch.device("cpu"), record, None)
    """
    _, frozen = split(task, task.init_params(rng_lib.key(config.seed), device))
    if init_from:
        frozen = ckpt_lib.restore(init_from, {"params": ckpt_lib.abstract(frozen)}).result()["params"]
    check(saved_record, record(frozen, source_of(config)), step_dir)
    return frozen


def record(frozen: dict, source: str) -> dict | None:
    """The checkpoints' record of the frozen params: {"source", "digest", "params"}; None when there are none.

    Example:
      >>> record(state.frozen, source_of(config))["digest"][:8]
      '3f2a9c1e'
    """
    if not frozen:
        return None
    table = digests.tensor_digests(frozen)
    return {"source": source, "digest": digests.digest(table=table), "params": sum(n for _, n in table.values())}


def check(saved_record: dict | None, current: dict | None, where: str) -> None:
    """Raises one `FrozenMismatch` line when the checkpoint at `where` was trained over other frozen params
    (or over none, or the run now has none) than the run's.

    Args:
      saved_record: the checkpoint's record (None: it trained every param).
      current: this run's record (None: it trains every param).
      where: the checkpoint step directory, for the line.
    """
    if saved_record is None and current is None:
        return
    if current is None:
        assert saved_record is not None  # (both None returned above)
        raise FrozenMismatch(
            f"{where} holds LoRA adapters trained over a frozen base ({saved_record['source']}), and this run trains "
            "every param; resume it with the same --config.lora.* flags, or start a new --workdir"
        )
    if saved_record is None:
        raise FrozenMismatch(
            f"{where} trained every param, and this run trains adapters over a frozen base (--config.lora.rank); "
            f"start a new --workdir with --config.checkpoint.init_from={where} to fine-tune those params"
        )
    if saved_record["digest"] != current["digest"]:
        raise FrozenMismatch(
            f"{where} trained its adapters over another base ({saved_record['source']}, digest "
            f"{saved_record['digest'][:12]}) than this run's ({current['source']}, digest {current['digest'][:12]}); "
            "give the same base (--config.model.path / --config.checkpoint.init_from)"
        )
