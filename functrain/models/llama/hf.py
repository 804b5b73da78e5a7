"""`functrain.models.llama` <-> Hugging Face `LlamaForCausalLM`: configs and parameter names.

Internals: docs/internals.md "functrain.models.llama.hf".

Example:
    >>> hf = HFDirectory("SmolLM-135M")
    >>> cfg = config_from_hf(hf.config, hf.path / "config.json")
    >>> params = load_hf_params(hf.weights, template, cfg)
    >>> save_hf_directory("out", export_hf_llama(params, cfg), hf_llama_config(cfg))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from functrain.interop.hf import HFError, HFWeights
from functrain.models.llama.model import LlamaConfig

__all__ = ["config_from_hf", "export_hf_llama", "hf_llama_config", "hf_name", "load_hf_params"]

ARCHITECTURES = ("LlamaForCausalLM",)


def hf_name(name: str) -> str:
    """Our parameter name -> Hugging Face's (`model.` prefix, except the untied head)."""
    return name if name == "lm_head.weight" else "model." + name


def config_from_hf(hf: Mapping[str, Any], path: str | Path = "config.json") -> LlamaConfig:
    """A `LlamaConfig` from a Hugging Face `config.json` dict.

    Args:
      hf: the parsed `config.json`.
      path: the file it came from (named in errors).

    Returns:
      The `LlamaConfig` of the same function.

    Raises:
      HFError: not a Llama, or a feature this model lacks (one line naming `path`).

    Example:
      >>> cfg = config_from_hf(json.loads(Path("SmolLM-135M/config.json").read_text()))
    """
    archs = list(hf.get("architectures") or [])
    if hf.get("model_type") != "llama" or (archs and not set(archs) & set(ARCHITECTURES)):
        raise HFError(
            f"{path}: architecture {archs or hf.get('model_type')!r} is not supported; functrain.models.llama "
            f"reads {', '.join(ARCHITECTURES)} (model_type 'llama')"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"{path}: hidden_act={hf['hidden_act']!r}; this Llama implements SwiGLU with SiLU only")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise HFError(f"{path}: rope scaling {kind!r} is not implemented (only 'default' rotary embeddings)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    heads = int(hf["num_attention_heads"])
    try:
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]),
            block_size=int(hf["max_position_embeddings"]),
            n_layer=int(hf["num_hidden_layers"]),
            n_head=heads,
            n_kv_head=int(hf.get("num_key_value_heads") or heads),
            n_embd=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            rope_theta=float(theta),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )
    except KeyError as exc:
        raise HFError(f"{path}: no {exc.args[0]!r}; not a complete Llama config") from None
    except ValueError as exc:
        raise HFError(f"{path}: {exc}") from None


def hf_llama_config(
    cfg: LlamaConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of `Llama(cfg)` (what `LlamaForCausalLM.from_pretrained` reads).

    Args:
      cfg: our config.
      bos_token_id: the tokenizer's begin-of-text id, if any.
      eos_token_id: its end-of-text id, if any.

    Returns:
      A JSON-able dict.

    Example:
      >>> (out / "config.json").write_text(json.dumps(hf_llama_config(cfg)))
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.block_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # older transformers
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers >= 5
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def export_hf_llama(params: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our params as a `LlamaForCausalLM` state dict (DTensors left as they are: the writer gathers them).

    Args:
      params: {name: tensor} of `Llama(cfg)`.
      cfg: its config (a tied model writes no `lm_head.weight`; `from_pretrained` re-ties it).

    Returns:
      {Hugging Face name: tensor}, dtypes kept.

    Example:
      >>> sd = export_hf_llama(state.params, cfg)
    """
    del cfg
    return {hf_name(n): t.detach() for n, t in params.items()}


def load_hf_params(
    weights: HFWeights,
    model: nn.Module,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    where: Callable | None = None,
) -> dict[str, torch.Tensor]:
    """`model`'s parameters read from a Hugging Face directory's tensors, each checked against its shape.

    Args:
      weights: `HFWeights` of the directory.
      model: the (meta-device) `Llama` built from its config.
      device: where to put the tensors.
      dtype: their dtype (the file's is cast).
      where: optional `where(name, shape) -> (offset, local_shape)`: read only that block of each
        parameter (`functrain.parallel.init_sharded`), so no rank reads the whole model.

    Returns:
      {name: tensor (or block)} in `model.named_parameters()` order.

    Raises:
      HFError: a tensor missing or of another shape (naming the file), or tensors the model lacks.

    Example:
      >>> params = load_hf_params(HFWeights("SmolLM-135M"), template)
    """
    out = {}
    wanted = set()
    for name, p in model.named_parameters():
        theirs = hf_name(name)
        wanted.add(theirs)
        if theirs not in weights:
            raise HFError(
                f"{weights.directory}: no tensor {theirs!r} (the config needs it); the checkpoint is "
                "incomplete or of another model"
            )
        if weights.shape(theirs) != tuple(p.shape):
            raise HFError(
                f"{weights.file(theirs)}: {theirs} has shape {weights.shape(theirs)}, but config.json "
                f"implies {tuple(p.shape)}; the weights and config.json disagree"
            )
        offset, local = where(name, p.shape) if where is not None else (None, None)
        out[name] = weights.read(theirs, offset, local).to(device=device, dtype=dtype)
    # The tied head may be stored too (some writers do); other leftovers mean another model.
    tied = cast(Any, model).cfg.tie_embeddings
    extra = sorted(
        n
        for n in weights.names()
        if n not in wanted and not n.endswith("rotary_emb.inv_freq") and not (n == "lm_head.weight" and tied)
    )
    if extra:
        raise HFError(
            f"{weights.file(extra[0])}: unexpected tensors {extra[:4]}{'...' if len(extra) > 4 else ''} "
            "for this config; check config.json (num_hidden_layers, tie_word_embeddings)"
        )
    return out
