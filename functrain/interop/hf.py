"""Hugging Face model directories, model-free: `config.json`, one or many `*.safetensors` shards,
`tokenizer.json`. A model family maps names and configs (`functrain.models.llama.hf`); this module
finds and reads the files, and writes a directory `transformers.AutoModelForCausalLM.from_pretrained`
loads.

Internals: docs/internals.md "functrain.interop.hf".

Example:
    >>> hf = HFDirectory("SmolLM-135M")
    >>> hf.config["model_type"], hf.weights.shape("model.norm.weight")
    ('llama', (576,))
    >>> save_hf_directory("out/hf", state_dict, config, tokenizer_file="SmolLM-135M/tokenizer.json")
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from functrain.errors import FunctrainError
from functrain.interop.safetensors import SafetensorsError, open_safetensors, rank_and_world, save_safetensors

__all__ = ["HFDirectory", "HFError", "HFWeights", "save_hf_directory"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class HFError(FunctrainError, ValueError):
    """A Hugging Face directory that cannot be used: one line naming the file and the problem."""


class HFWeights:
    """The tensors of a directory's safetensors file(s), read by name and by block.

    Args:
      directory: a directory with `model.safetensors`, or `model.safetensors.index.json` and the
        shards its `weight_map` names.

    Raises:
      HFError: no weights, an unreadable index, a missing or corrupt shard (naming it).

    Example:
      >>> w = HFWeights("SmolLM-135M")
      >>> w.read("model.embed_tokens.weight", offset=(0, 0), local_shape=(100, 576)).shape
      torch.Size([100, 576])
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / _INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise HFError(f"{index}: not a safetensors index ({exc!r}); re-save the model") from None
            self._file_of: dict | None = {name: self.directory / f for name, f in weight_map.items()}
        elif (self.directory / _SINGLE).exists():
            self._file_of = None
        else:
            raise HFError(
                f"{self.directory}: no {_SINGLE} or {_INDEX}; save the model with safetensors "
                "(save_pretrained(..., safe_serialization=True))"
            )
        files = sorted(set(self._file_of.values())) if self._file_of else [self.directory / _SINGLE]
        for f in files:
            if not f.exists():
                raise HFError(f"{f}: shard named in {_INDEX} is missing; copy the whole checkpoint directory")
        self._handles: dict[Path, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for f in files:
            h = self._open(f)
            for name in h.keys():
                sl = h.get_slice(name)
                self._shapes[name] = tuple(sl.get_shape())
                self._dtypes[name] = sl.get_dtype()
                if self._file_of is None:
                    continue
                if self._file_of.get(name) != f:
                    raise HFError(f"{f}: holds {name!r}, which {_INDEX} places elsewhere; re-save the model")
        if self._file_of is not None:
            absent = sorted(n for n in self._file_of if n not in self._shapes)
            if absent:
                raise HFError(
                    f"{self._file_of[absent[0]]}: has no {absent[0]!r} (named in {_INDEX}); "
                    "the shard is truncated or from another checkpoint"
                )

    def _open(self, f: Path):
        """The open safetensors handle of shard `f`."""
        if f not in self._handles:
            try:
                self._handles[f] = open_safetensors(f)
            except SafetensorsError as exc:
                raise HFError(str(exc)) from None
        return self._handles[f]

    def names(self) -> list[str]:
        """Every tensor name in the directory."""
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def file(self, name: str) -> Path:
        """The file that holds `name`."""
        return self._file_of[name] if self._file_of else self.directory / _SINGLE

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of `name` (KeyError when absent)."""
        return self._shapes[name]

    def read(
        self, name: str, offset: Sequence[int] | None = None, local_shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Tensor `name`, or only its block at `offset` of size `local_shape` (read from disk alone).

        Args:
          name: a tensor name of the directory.
          offset: the block's first index per dim (default: the whole tensor).
          local_shape: the block's size per dim.

        Returns:
          A CPU tensor in the stored dtype.

        Example:
          >>> w.read("lm_head.weight", (1024, 0), (1024, 576))   # rows 1024..2047
        """
        h = self._open(self.file(name))
        if offset is None or local_shape is None:
            return h.get_tensor(name)
        index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
        return h.get_slice(name)[index] if index else h.get_tensor(name)


class HFDirectory:
    """A local Hugging Face model directory: its config, weights and (optional) tokenizer file.

    Args:
      directory: the path (e.g. what `save_pretrained` wrote).

    Raises:
      HFError: the directory or its `config.json` is missing or not JSON.

    Example:
      >>> hf = HFDirectory("runs/llama/hf")
      >>> hf.config["architectures"], hf.tokenizer_file
    """

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory).expanduser()
        config = self.path / "config.json"
        if not self.path.is_dir():
            raise HFError(
                f"{self.path}: not a directory; give a Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer.json)"
            )
        try:
            self.config: dict[str, Any] = json.loads(config.read_text())
        except FileNotFoundError:
            raise HFError(f"{config}: missing; a Hugging Face model directory has a config.json") from None
        except ValueError as exc:
            raise HFError(f"{config}: not JSON ({exc})") from None
        self._weights: HFWeights | None = None

    @property
    def weights(self) -> HFWeights:
        """The directory's tensors (opened on first use)."""
        if self._weights is None:
            self._weights = HFWeights(self.path)
        return self._weights

    @property
    def tokenizer_file(self) -> Path | None:
        """`tokenizer.json` when the directory has one."""
        f = self.path / "tokenizer.json"
        return f if f.exists() else None


def save_hf_directory(
    directory: str | os.PathLike,
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    tokenizer_file: str | os.PathLike | None = None,
) -> Path:
    """Writes a directory `from_pretrained` loads: `config.json`, `model.safetensors`, `tokenizer.json`.

    Tensors are streamed to the file one at a time (`save_safetensors`): DTensors are gathered one
    by one and rank 0 writes, so with sharded params every rank must call it (a collective), and
    none holds the whole model. Plain tensors on one process: no communication.

    Args:
      directory: where to write (created).
      state_dict: {Hugging Face name: tensor or DTensor}.
      config: the model's `config.json` contents.
      tokenizer_file: a `tokenizer.json` to copy beside the weights (optional).

    Returns:
      The directory.

    Example:
      >>> save_hf_directory("runs/llama/hf", export_hf_llama(params, cfg), hf_llama_config(cfg))
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():  # (every rank sees it: no rank starts a collective alone)
        raise HFError(
            f"{out}: is a file, not a directory; export to another path (a new directory, or one to "
            "overwrite), or move the file away"
        )
    save_safetensors(dict(state_dict), out / _SINGLE, metadata={"format": "pt"})  # every rank; rank 0 writes
    rank, distributed = rank_and_world()
    if rank == 0:
        (out / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
        if tokenizer_file is not None and Path(tokenizer_file).resolve() != (out / "tokenizer.json").resolve():
            shutil.copyfile(tokenizer_file, out / "tokenizer.json")
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    return out
