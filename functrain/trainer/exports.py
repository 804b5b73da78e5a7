"""A run's Hugging Face exports: the paths they go to checked before step 1, and each directory checked once
written: transformers loads it and its logits on a probe equal the run's own, else one line.

Example:
    >>> exports.check_targets(exports.targets(Path("runs/sft/hf"), lora=True))
    >>> path, note = exports.write(task, params, Path("runs/sft/hf"))
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from functrain.eval.model import EvalModel
from functrain.interop.hf import HFError
from functrain.nn.lora import peft_directory
from functrain.task import Task
from functrain.trainer.validate import ConfigError

__all__ = ["check_targets", "targets", "verify", "write"]

PROBE_TOKENS = 16


def targets(out: Path, *, lora: bool) -> list[Path]:
    """The paths an export to `out` writes: `out`, and with LoRA the PEFT directory beside it (`<out>-peft`)."""
    return [out, peft_directory(out)] if lora else [out]


def check_targets(paths: list[Path], flag: str = "--config.export_hf") -> None:
    """Refuses, before anything is trained, an export path that cannot become a directory.

    Args:
      paths: the directories the export will write (`targets`).
      flag: what chose them, for the fix.

    Raises:
      ConfigError: a path that is a file, or whose parent cannot be written (one line naming it and the fix).

    Example:
      >>> check_targets([Path("runs/sft/hf"), Path("runs/sft/hf-peft")])
    """
    for path in paths:
        if path.exists() and not path.is_dir():
            raise ConfigError(
                f"{path} is a file, and the export at the end writes a directory there; move the file away or "
                f"export elsewhere ({flag})"
            )
        parent = next((p for p in [path, *path.parents] if p.exists()), Path("."))
        if not os.access(parent, os.W_OK):
            raise ConfigError(f"{path}: {parent} cannot be written, so the export would fail at the end; ({flag})")


def write(task: Task, params, out: Path) -> tuple[Path, str | None]:
    """`task.export(params, out)`, then `verify` on the directory written.

    Args:
      task: the run's task (its `export` and `eval_model`).
      params: base and trained params together (sharded: every rank calls this).
      out: the directory.

    Returns:
      (the directory, a note line when it could not be checked, else None).

    Raises:
      HFError: transformers' logits of the export differ from the run's (one line).

    Example:
      >>> path, note = write(task, frozen.merged(state), Path("runs/hf/hf"))
    """
    assert task.export is not None, "a task without an export format"
    path = Path(task.export(params, out))
    note = verify(path, task.eval_model, params) if task.eval_model is not None else "not checked: no eval_model"
    return path, note


def _probe(vocab: int, n: int) -> torch.Tensor:
    """(1, n) ids spread over the vocabulary, the same in every process."""
    return (torch.arange(n, dtype=torch.long) * 7919 + 11) % vocab


def verify(path: Path, model: EvalModel, params) -> str | None:
    """Loads the exported directory with transformers and compares its logits on a probe with the run's.

    Args:
      path: the export.
      model: the run's `EvalModel` (its logits of `params`).
      params: the params exported (sharded: every rank calls this; rank 0 loads the directory).

    Returns:
      None when checked; a note line when transformers is not installed.

    Raises:
      HFError: the logits differ beyond float32 rounding, or transformers cannot load it (one line).

    Example:
      >>> verify(Path("runs/hf/hf"), task.eval_model, params)
    """
    try:
        import transformers
    except ImportError:
        return f"{path}: written; not checked against transformers (not installed: pip install 'functrain[hf]')"
    import json

    vocab = int(json.loads((path / "config.json").read_text()).get("vocab_size", 256))
    ids = _probe(vocab, min(PROBE_TOKENS, model.block_size))[None]
    ours = model.logits(params, None, ids.to(_device(params))).float().cpu()  # (1, T, V); collectives when sharded
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    verdict = torch.zeros(2, dtype=torch.float64)  # (failed, the largest difference)
    message = ""
    if rank == 0:
        try:
            loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
            with torch.no_grad():
                theirs = loaded.eval()(input_ids=ids, use_cache=False).logits.float()  # (no cache: logits only)
            diff = float((theirs[..., : ours.shape[-1]] - ours).abs().max())
            verdict[:] = torch.tensor([float(diff > 1e-3 * (1.0 + float(ours.abs().max()))), diff])
        except Exception as exc:  # noqa: BLE001 - transformers' own failures to load, in one line
            verdict[0], message = 2.0, " ".join(str(exc).split())[:300]
    if torch.distributed.is_initialized():  # every rank raises or returns alike
        shared = verdict.to(_device(params))
        torch.distributed.broadcast(shared, src=0)
        verdict = shared.cpu()
    if verdict[0] == 2.0:
        raise HFError(f"{path}: written, but transformers cannot load it ({message or 'see rank 0'})")
    if verdict[0] == 1.0:
        raise HFError(
            f"{path}: written, but transformers' logits of it differ from the run's by {float(verdict[1]):.3g} on a "
            "probe: the export does not hold the model the run trained (its params, buffers or config); "
            "the checkpoints are intact"
        )
    return None


def _device(params) -> torch.device:
    """Where the params compute."""
    leaf = next(iter(params.values()))
    return (leaf.to_local() if hasattr(leaf, "to_local") else leaf).device
