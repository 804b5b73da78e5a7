"""Convert `functrain.models.gpt.GPT` parameters to and from Hugging Face GPT-2 (`GPT2LMHeadModel`) names.

Internals: docs/internals.md "functrain.models.gpt.hf".

Example:
    >>> sd = export_hf_gpt2(state.params, cfg)
    >>> save_safetensors(sd, "hf/model.safetensors", metadata={"format": "pt"})
    >>> params = import_hf_gpt2(load_safetensors("hf/model.safetensors"), cfg)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from functrain.models.gpt.model import GPTConfig

__all__ = ["export_hf_gpt2", "import_hf_gpt2", "hf_gpt2_config"]

_PREFIX = "transformer."
_LINEARS = (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj"))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (D)Tensor, detached."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach()


def _bias(params: Mapping[str, torch.Tensor], name: str, like: torch.Tensor, n: int) -> torch.Tensor:
    """params[name], or zeros (n,) in `like`'s dtype/device when the model has no biases."""
    if name in params:
        return _full(params[name])
    return torch.zeros(n, dtype=like.dtype, device=like.device)


def export_hf_gpt2(params: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our GPT params as a Hugging Face `GPT2LMHeadModel` state dict (without the tied lm_head).

    Args:
      params: {name: tensor} of a `GPT(cfg)` (DTensors are gathered with `full_tensor()`).
      cfg: its `GPTConfig`; with `bias=False` zero biases are written.

    Returns:
      {hf_name: contiguous tensor}, dtypes kept. `lm_head.weight` is left out (GPT-2 ties it to
      `transformer.wte.weight`; `from_pretrained` re-ties it); add it yourself if a tool wants it.

    Example:
      >>> sd = export_hf_gpt2(params, cfg)
      >>> hf_model.load_state_dict(sd, strict=False)   # or save_safetensors(sd, ...)
    """
    c = cfg.n_embd
    p = params
    out: dict[str, torch.Tensor] = {
        _PREFIX + "wte.weight": _full(p["wte.weight"]),
        _PREFIX + "wpe.weight": _full(p["wpe.weight"]),
    }
    for i in range(cfg.n_layer):
        ours, hf = f"blocks.{i}.", f"{_PREFIX}h.{i}."
        for ln in ("ln_1", "ln_2"):
            w = _full(p[ours + ln + ".weight"])
            out[hf + ln + ".weight"] = w
            out[hf + ln + ".bias"] = _bias(p, ours + ln + ".bias", w, c)
        qkv = [_full(p[f"{ours}attn.{n}.weight"]) for n in "qkv"]  # 3 x (C, C), (out, in)
        out[hf + "attn.c_attn.weight"] = torch.cat(qkv, dim=0).t().contiguous()  # (C, 3C)
        out[hf + "attn.c_attn.bias"] = torch.cat([_bias(p, f"{ours}attn.{n}.bias", qkv[0], c) for n in "qkv"])
        for mine, theirs in _LINEARS:
            w = _full(p[f"{ours}{mine}.weight"])  # (out, in)
            out[f"{hf}{theirs}.weight"] = w.t().contiguous()  # (in, out)
            out[f"{hf}{theirs}.bias"] = _bias(p, f"{ours}{mine}.bias", w, w.shape[0])
    w = _full(p["ln_f.weight"])
    out[_PREFIX + "ln_f.weight"] = w
    out[_PREFIX + "ln_f.bias"] = _bias(p, "ln_f.bias", w, c)
    return out


def _is_buffer(name: str) -> bool:
    """GPT-2's non-parameter entries: the causal-mask buffers `h.{i}.attn.bias` / `.masked_bias`."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "h" and parts[2] == "attn" and parts[3] in ("bias", "masked_bias")


def import_hf_gpt2(state_dict: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:  # noqa: C901
    """A Hugging Face GPT-2 state dict as params for `GPT(cfg)`, in `GPT(cfg).named_parameters()` order.

    Accepts `GPT2LMHeadModel` names (`transformer.` prefix) and `GPT2Model` names (no prefix, as in
    the hub's `gpt2/model.safetensors`). Attention-mask buffers are ignored; `lm_head.weight`, when
    present, must equal `transformer.wte.weight` (our head is tied).

    Args:
      state_dict: {name: tensor}, e.g. `load_safetensors(...)` or `hf_model.state_dict()`.
      cfg: the target `GPTConfig` (sizes must match the weights; `bias=False` needs zero biases).

    Returns:
      {name: tensor} ready for `functional_call` / `init_state`; dtypes kept.

    Raises:
      ValueError: missing or unexpected entries, shapes that do not fit `cfg`, nonzero biases
        for a `bias=False` config, or an untied lm_head.

    Example:
      >>> params = import_hf_gpt2(load_safetensors("gpt2/model.safetensors"), cfg)
    """
    sd = {}
    for name, t in state_dict.items():
        short = name[len(_PREFIX) :] if name.startswith(_PREFIX) else name
        if not _is_buffer(short):
            sd[short] = t
    head = sd.pop("lm_head.weight", None)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """sd[name], checked against `shape`."""
        if name not in sd:
            raise ValueError(f"Hugging Face GPT-2 state dict has no {name!r} (needed for n_layer={cfg.n_layer})")
        t = _full(sd[name])
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, but cfg needs {shape}; check the GPTConfig "
                "(vocab_size, block_size, n_embd)"
            )
        used.add(name)
        return t

    def bias(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The bias, or None (after checking it is zero) when the config has no biases."""
        b = take(name, shape)
        if cfg.bias:
            return b
        if torch.count_nonzero(b):
            raise ValueError(f"{name} is nonzero but cfg.bias=False would drop it; use a GPTConfig with bias=True")
        return None

    c = cfg.n_embd
    params: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor | None) -> None:
        """Adds a parameter (skips absent biases)."""
        if t is not None:
            params[name] = t.contiguous()

    put("wte.weight", take("wte.weight", (cfg.vocab_size, c)))
    put("wpe.weight", take("wpe.weight", (cfg.block_size, c)))
    for i in range(cfg.n_layer):
        ours, hf = f"blocks.{i}.", f"h.{i}."
        put(ours + "ln_1.weight", take(hf + "ln_1.weight", (c,)))
        put(ours + "ln_1.bias", bias(hf + "ln_1.bias", (c,)))
        qkv_w = take(hf + "attn.c_attn.weight", (c, 3 * c)).t()  # (3C, C) = [q; k; v]
        qkv_b = bias(hf + "attn.c_attn.bias", (3 * c,))
        for j, n in enumerate("qkv"):
            put(f"{ours}attn.{n}.weight", qkv_w[j * c : (j + 1) * c])
            put(f"{ours}attn.{n}.bias", None if qkv_b is None else qkv_b[j * c : (j + 1) * c])
        sizes = {"attn.proj": (c, c), "mlp.fc": (4 * c, c), "mlp.proj": (c, 4 * c)}  # ours, (out, in)
        for mine, theirs in _LINEARS:
            out_f, in_f = sizes[mine]
            put(f"{ours}{mine}.weight", take(f"{hf}{theirs}.weight", (in_f, out_f)).t())
            put(f"{ours}{mine}.bias", bias(f"{hf}{theirs}.bias", (out_f,)))
        put(ours + "ln_2.weight", take(hf + "ln_2.weight", (c,)))
        put(ours + "ln_2.bias", bias(hf + "ln_2.bias", (c,)))
    put("ln_f.weight", take("ln_f.weight", (c,)))
    put("ln_f.bias", bias("ln_f.bias", (c,)))

    extra = sorted(set(sd) - used)
    if extra:
        more = "..." if len(extra) > 8 else ""
        raise ValueError(f"unexpected entries for a {cfg.n_layer}-layer GPT-2: {extra[:8]}{more}")
    if head is not None and not torch.equal(_full(head), params["wte.weight"]):
        raise ValueError("lm_head.weight differs from transformer.wte.weight; functrain's GPT ties them")
    return _in_model_order(params, cfg)


def _in_model_order(params: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """`params` reordered as `GPT(cfg).named_parameters()` (a fixed key order avoids recompiles)."""
    from functrain.models.gpt import GPT

    with torch.device("meta"):
        names = [n for n, _ in GPT(cfg).named_parameters()]
    return {n: params[n] for n in names}


def hf_gpt2_config(cfg: GPTConfig) -> dict[str, Any]:
    """A Hugging Face `GPT2Config` dict (`config.json`) describing the same function as `GPT(cfg)`.

    Args:
      cfg: our `GPTConfig`.

    Returns:
      A JSON-able dict; write it next to the exported `model.safetensors` for `from_pretrained`.

    Example:
      >>> Path("hf/config.json").write_text(json.dumps(hf_gpt2_config(cfg)))
    """
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu",  # exact GELU, as F.gelu; GPT-2's own default is "gelu_new"
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": 0.0,  # our attention has no dropout on the probabilities
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": 50256 if cfg.vocab_size > 50256 else None,  # GPT-2's <|endoftext|> when it exists
        "eos_token_id": 50256 if cfg.vocab_size > 50256 else None,
    }
