"""A tiny transformers model directory to try the Hugging Face family offline: `config.json` of a small
model of any decoder type (256 ids: byte-level, no tokenizer needed), no weights.

Internals: docs/internals.md "functrain.models.hf.tiny".

Example:
    >>> write_tiny("runs/llama-tiny", "llama", hidden_size=64)
    PosixPath('runs/llama-tiny')
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["TINY", "model_directory", "write_tiny"]

TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
"""The tiny shape: byte-level (256 ids), 2 layers of width 128, 4 query and 2 key/value heads."""


def write_tiny(directory: str | os.PathLike, model_type: str, **overrides) -> Path:
    """Writes `<directory>/config.json` of a tiny `model_type` causal LM (transformers' own config class).

    Args:
      directory: where (created).
      model_type: a transformers model type ("llama", "qwen2", "mistral", "gemma", "phi3", "gpt2", ...).
      **overrides: config values in place of `TINY`'s.

    Returns:
      The directory.

    Example:
      >>> write_tiny("runs/gpt2-tiny", "gpt2", num_hidden_layers=4)
    """
    import transformers

    values = {**TINY, **overrides}
    config = transformers.AutoConfig.for_model(model_type, **values)
    model_class: Any = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    config.architectures = [model_class.__name__]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str) + "\n")
    return out


def model_directory(path: str, workdir: str | os.PathLike) -> str:
    """`model.path` as a directory: "tiny:<type>" is a tiny `<type>` written (once) to `<workdir>/tiny-<type>`.

    Example:
      >>> model_directory("tiny:qwen2", "runs/sft")
      'runs/sft/tiny-qwen2'
    """
    if not path.startswith("tiny:"):
        return path
    out = Path(workdir) / f"tiny-{path[5:]}"
    if not (out / "config.json").exists():
        write_tiny(out, path[5:])
    return str(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Writes a tiny transformers model directory (config.json).")
    parser.add_argument("directory")
    parser.add_argument("--type", default="qwen2", help="a transformers model type (llama, qwen2, mistral, gpt2, ...)")
    args = parser.parse_args()
    print(write_tiny(args.directory, args.type))
