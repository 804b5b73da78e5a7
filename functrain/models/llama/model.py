"""A Llama-family decoder (Llama 2/3, SmolLM, TinyLlama shapes), written for functional training.

Internals: docs/internals.md "functrain.models.llama.model".

Example:
    >>> cfg = LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    >>> with torch.device("meta"):
    ...     template = Llama(cfg)
    >>> params = init_params(template, rng.key(0))
    >>> logits = torch.func.functional_call(template, params, (idx,))   # (B, T, V)
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops.layers.torch import Rearrange

from functrain import ops, rng
from functrain.models import stages as stages_lib
from functrain.models.lm import make_lm_loss_fn
from functrain.models.stages import LMStages, init_blocks
from functrain.step.staged import Stage

__all__ = [
    "LlamaConfig",
    "Llama",
    "TP_RULES",
    "flops_per_token",
    "head_name",
    "init_params",
    "make_loss_fn",
    "num_params",
    "stages",
]


@dataclasses.dataclass
class LlamaConfig:
    """Hyper-parameters of a Llama-family model.

    Args:
      vocab_size: number of token ids.
      block_size: maximum context length (Hugging Face's `max_position_embeddings`).
      n_layer: number of decoder blocks.
      n_head: query heads.
      n_kv_head: key/value heads (grouped-query attention); must divide n_head. n_head = MHA.
      n_embd: model width.
      intermediate_size: SwiGLU hidden width; 0 = 8/3 n_embd rounded up to a multiple of 64.
      head_dim: per-head width; 0 = n_embd // n_head.
      rope_theta: rotary base.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the head reuses the token embedding (SmolLM: yes; Llama 2/3 8B: no).
      attention_bias: biases on q/k/v/o (Llama: no; some derivatives: yes).
      mlp_bias: biases on gate/up/down.
      dropout: drop probability on the attention and MLP outputs and the embedding, when a dropout
        key is given (0: Llama's pretraining recipe).

    Example:
      >>> cfg = LlamaConfig(vocab_size=49152, block_size=2048, n_layer=30, n_head=9, n_kv_head=3,
      ...                   n_embd=576, intermediate_size=1536, tie_embeddings=True)  # SmolLM-135M
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 128
    intermediate_size: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (grouped-query attention)")
        if not self.head_dim:
            if self.n_embd % self.n_head:
                raise ValueError(
                    f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick n_head "
                    "dividing n_embd or set head_dim"
                )
            self.head_dim = self.n_embd // self.n_head
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")
        if not self.intermediate_size:
            self.intermediate_size = 64 * math.ceil(8 * self.n_embd / 3 / 64)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean square taken in float32 (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., C) in x's dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(
    head_dim: int, theta: float, t: int, device, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim) of positions 0..t-1 (or of `positions`: (T,), or (B, T) for packed rows,
    giving (B, T, head_dim)), float32; frequency j repeats at j and j + D/2."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))  # (D/2,)
    pos = torch.arange(t, device=device) if positions is None else positions  # (T,) or (B, T)
    freqs = pos.float()[..., None] * inv_freq  # (..., T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, D)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates (B, H, T, D) queries or keys: x cos + rotate_half(x) sin, rotate_half = (-x2, x1);
    cos/sin (T, D), or (B, T, D) per row."""
    if cos.ndim == 3:  # (B, T, D) -> (B, 1, T, D): the same rotation for every head
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, D/2) each
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, H, T, D)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings on q and k."""

    context = None  # a `parallel.context.Split`: this rank holds part of each sequence (context_parallel)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        d, b = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * d, bias=b)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * d, bias=b)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * d, bias=b)
        self.o_proj = nn.Linear(cfg.n_head * d, cfg.n_embd, bias=b)
        # Head counts come from the tensors, so a TP-local slice of heads runs unchanged. Layers, not
        # `einops.rearrange` calls: torch.compile would trace the pattern's parse at every call.
        self.split_heads = Rearrange("b t (h d) -> b h t d", d=d)
        self.merge_heads = Rearrange("b h t d -> b t (h d)")

    def forward(self, x: torch.Tensor, dropout_key: torch.Tensor | None = None, packed=None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C); `packed` (`models.lm.Packed`): rows of documents, each seeing only itself."""
        d = self.cfg.head_dim
        q = self.split_heads(self.q_proj(x))  # (B, H, T, D)
        k = self.split_heads(self.k_proj(x))  # (B, Hkv, T, D)
        v = self.split_heads(self.v_proj(x))  # (B, Hkv, T, D)
        t = x.shape[1]
        pos = None if self.context is None else self.context.positions(t, x.device)  # (T,) global positions
        if packed is not None:
            pos = packed.positions  # (B, T): restarting at every document
        cos, sin = rotary(d, self.cfg.rope_theta, t, x.device, pos)  # (T, D) each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.context is not None:  # this rank's queries over every rank's (few) kv heads
            y = self.merge_heads(self.context.attention(q, k, v))  # (B, T, H*D)
            return rng.dropout(self.o_proj(y), self.cfg.dropout, dropout_key)
        if packed is not None:  # (a KV cache: these keys and values written, the cache's returned)
            k, v = packed.keys_values(k, v)  # (B, Hkv, T or L, D)
        group = q.shape[1] // k.shape[1]  # query heads per kv head; kv head j serves q heads j*group...
        k = k[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)  # (B, Hkv, G, T, D) -> (B, H, T, D)
        v = v[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)  # (B, Hkv, G, T, D) -> (B, H, T, D)
        if packed is not None:  # block-causal, or over a KV cache
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.mask)  # (B, H, T, D)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = self.merge_heads(y)  # (B, T, H*D)
        return rng.dropout(self.o_proj(y), self.cfg.dropout, dropout_key)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, dropout_key: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        return rng.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.dropout, dropout_key)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, attn_key=None, mlp_key=None, packed=None):
        """(B, T, C) -> (B, T, C)."""
        x = x + self.self_attn(self.input_layernorm(x), attn_key, packed)
        return x + self.mlp(self.post_attention_layernorm(x), mlp_key)


class Llama(nn.Module):
    """Llama-family language model: token embedding, `n_layer` blocks, final RMSNorm, head.

    Args:
      cfg: a `LlamaConfig`.

    Returns (forward):
      `forward(idx, dropout_key=None, *, return_hidden=False)`: int64 ids (B, T), T <= block_size ->
      logits (B, T, vocab_size), or the hidden states (B, T, C) after `norm` with `return_hidden`.

    Example:
      >>> with torch.device("meta"):
      ...     template = Llama(cfg)                     # shapes only
      >>> params = init_params(template, rng.key(0))    # real tensors
    """

    context = None  # a `parallel.context.Split`: this rank holds part of each sequence (context_parallel)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # named_parameters() lists it once

    def embed(self, weight: torch.Tensor, idx: torch.Tensor, key) -> torch.Tensor:
        """Token ids (B, T) -> (B, T, C), dropout site 0 (used by the forward and the embed stage)."""
        t = idx.shape[1] * (1 if self.context is None else self.context.world)  # the whole sequence
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        return rng.dropout(ops.embedding(weight, idx), self.cfg.dropout, stages_lib.site_key(key, 0))  # (B, T, C)

    def get_output_embeddings(self) -> nn.Linear:
        """The output layer (transformers' name for it: LoRA's "all-linear" leaves it out, as PEFT's)."""
        return self.lm_head

    def forward(
        self, idx: torch.Tensor, dropout_key: torch.Tensor | None = None, *, packed=None, return_hidden: bool = False
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V), or hidden states (B, T, C) with `return_hidden`; `packed`
        (`models.lm.packed(positions)`): rows of several documents, each seeing only itself; or a
        `generation.kv_cache.Cached` view: the new tokens of rows whose earlier keys and values are cached."""
        key = stages_lib.dropout_key(self.cfg.dropout, dropout_key)
        x = self.embed(self.embed_tokens.weight, idx, key)  # (B, T, C)
        x = self.norm(stages_lib.run_blocks(self.layers, x, key, packed))  # (B, T, C)
        return x if return_hidden else self.lm_head(x)  # (B, T, V)


def stages(model: Llama) -> LMStages:
    """`model`'s forward up to the hidden states after `norm`, as `functrain.step.staged` stages.

    Each stage reads only its own parameters and runs its submodule functionally, so a
    tensor-parallel copy of the model works unchanged, and on sharded params the train step gathers
    one block at a time. `final(blocks[-1](...(embed(idx))))` equals the forward with `return_hidden`.

    Args:
      model: a `Llama` (a meta-device template is fine).

    Returns:
      `LMStages(embed, blocks, final)`; `functrain.models.llama.make_loss_fn` adds the head and loss.

    Example:
      >>> st = stages(template)
      >>> h = st.embed.fn(st.embed.params(params), idx, key)
    """
    cfg = model.cfg

    def embed(p, idx, key, packed=None):
        """Token ids (B, T) -> embeddings (B, T, C) (positions enter in the attention)."""
        return model.embed(p["embed_tokens.weight"], idx, stages_lib.dropout_key(cfg.dropout, key))

    return LMStages(
        embed=Stage(("embed_tokens.weight",), embed),
        blocks=stages_lib.block_stages(model, "layers", cfg.dropout),
        final=stages_lib.norm_stage(model, "norm."),
    )


def _init_block(model: Llama, name: str, shape, key: torch.Tensor, offset, local_shape) -> torch.Tensor:
    """The block (`offset`, `local_shape`) of parameter `name`'s initial value, on CPU float32."""
    if name.endswith("bias"):
        return torch.zeros(local_shape)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(local_shape)
    std = 0.02  # Hugging Face's initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight")):  # residual projections: depth-scaled
        std = 0.02 / math.sqrt(2 * model.cfg.n_layer)
    k = rng.fold_in(key.cpu(), zlib.crc32(name.encode()))
    return rng.normal(k, shape, offset=offset, local_shape=local_shape) * std


def init_params(
    model: Llama, key: torch.Tensor, *, device=None, dtype: torch.dtype = torch.float32, where: Callable | None = None
) -> dict[str, torch.Tensor]:
    """Fresh parameters for `model`, each a pure function of (key, its name, its shape).

    normal(0, 0.02) for the embedding and projections (0.02 / sqrt(2 n_layer) for o_proj and
    down_proj), ones for the RMSNorm weights, zeros for biases; drawn row by row by `rng.normal`, so
    any block can be drawn alone (sharded init, bit-identical to the whole).

    Args:
      model: a `Llama` (its parameters may live on "meta").
      key: an `rng` key.
      device: where to put the tensors (default CPU).
      dtype: floating dtype.
      where: optional `where(name, shape) -> (offset, local_shape)`: draw only that block of each
        parameter (`functrain.parallel.init_sharded` passes it).

    Returns:
      {name: tensor (or block)} in `model.named_parameters()` order.

    Example:
      >>> params = init_params(template, rng.key(0), device="cuda")
    """
    return init_blocks(model, key, _init_block, device=device, dtype=dtype, where=where)


TP_RULES: list[tuple[str, str]] = [
    (r"^layers\.\d+\.self_attn\.(q|k|v)_proj\.(weight|bias)$", "colwise"),
    (r"^layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias)$", "colwise"),
    (r"^layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$", "rowwise"),
    (r".*", "replicate"),
]
"""Tensor-parallel rules for `Llama` (first `re.search` match wins): q/k/v and gate/up colwise (each
rank holds whole query and kv heads: n_kv_head must divide by the TP degree), o/down rowwise,
embeddings, norms and the head replicated. See `functrain.models.gpt.TP_RULES` for the kinds."""


def num_params(cfg: LlamaConfig, non_embedding: bool = False) -> int:
    """Number of parameters of `Llama(cfg)` from the config alone.

    Args:
      cfg: a `LlamaConfig`.
      non_embedding: leave out the token embedding when it is not also the head (a lookup, no matmul).

    Returns:
      The count (a tied embedding/head counted once).

    Example:
      >>> num_params(LlamaConfig(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
      ...                        intermediate_size=1536, tie_embeddings=True))   # 134,515,008
    """
    c, d, f = cfg.n_embd, cfg.head_dim, cfg.intermediate_size
    attn = c * d * (2 * cfg.n_head + 2 * cfg.n_kv_head) + cfg.attention_bias * (
        d * (cfg.n_head + 2 * cfg.n_kv_head) + c
    )
    mlp = 3 * c * f + cfg.mlp_bias * (2 * f + c)
    embed = cfg.vocab_size * c
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * c
    n = embed + cfg.n_layer * (attn + mlp + 2 * c) + c + head
    return n - embed if non_embedding and not cfg.tie_embeddings else n


def flops_per_token(cfg: LlamaConfig) -> float:
    """Training FLOPs per token: 6 N + 12 L (n_head head_dim) T (see `functrain.models.gpt.flops_per_token`).

    Args:
      cfg: a `LlamaConfig`.

    Returns:
      FLOPs per trained token (N: every matmul weight, the head included, the lookup-only embedding not).

    Example:
      >>> flops_per_token(cfg) * tokens_per_second / peak_flops   # MFU
    """
    n = num_params(cfg, non_embedding=True)
    return float(6 * n + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size)


def head_name(cfg) -> str:
    """The output projection's weight: the token embedding when tied, else `lm_head.weight`."""
    return "embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"


def make_loss_fn(
    model: nn.Module, *, chunk_size: int = 0, ignore_index: int = -1, remat: str | int = "none", staged: bool = False
) -> Callable:
    """`loss_fn(params, (x, y), key) -> (loss, {})` of a `Llama`: `functrain.models.lm.make_lm_loss_fn` over its
    stages and head (the tied embedding or `lm_head`).

    Args:
      model: the (meta-device) Llama template, or its tensor-parallel copy.
      chunk_size, ignore_index, remat, staged: as `functrain.models.lm.make_lm_loss_fn`'s.

    Returns:
      The loss function.

    Example:
      >>> loss, aux = make_loss_fn(template, remat="full")(params, (x, y), None)
    """
    return make_lm_loss_fn(
        model,
        stages(cast(Llama, model)),
        head=head_name(model.cfg),
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        remat=remat,
        staged=staged,
    )
