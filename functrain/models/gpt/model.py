"""A GPT-2 style decoder-only transformer (nanoGPT-shaped), written for functional training.

Internals: docs/internals.md "functrain.models.gpt.model".

Example:
    >>> cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
    >>> model = GPT(cfg)
    >>> params = dict(model.named_parameters())
    >>> logits = torch.func.functional_call(model, params, (idx,), {"dropout_key": rng.key(0)})
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
from functrain.models.lm import lm_hidden, lm_loss, make_lm_loss_fn
from functrain.models.stages import LMStages, init_blocks
from functrain.step.staged import Stage

__all__ = [
    "GPTConfig",
    "GPT",
    "GPTStages",
    "TP_RULES",
    "flops_per_token",
    "gpt_hidden",
    "gpt_loss",
    "head_name",
    "init_params",
    "make_loss_fn",
    "num_params",
    "stages",
]


@dataclasses.dataclass
class GPTConfig:
    """Hyper-parameters of a GPT.

    Args:
      vocab_size: number of token ids (256 for byte-level text).
      block_size: maximum context length (size of the position embedding).
      n_layer: number of transformer blocks.
      n_head: attention heads per block; must divide n_embd.
      n_embd: model width.
      dropout: drop probability used at every dropout site when a dropout key is given.
      bias: whether Linear and LayerNorm layers have biases (GPT-2: True).

    Example:
      >>> cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384)
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick n_head dividing n_embd"
            )


def _embed(
    cfg: GPTConfig,
    wte: torch.Tensor,
    wpe: torch.Tensor,
    idx: torch.Tensor,
    key,
    context=None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token + position embedding of ids (B, T) -> (B, T, C), dropout site 0: the one definition,
    used by `GPT.forward` and by the embedding stage of `stages` (`context`: a sequence split's part;
    `positions` (B, T): packed rows' positions, restarting at each document)."""
    t = idx.shape[1]
    world = 1 if context is None else context.world
    if t * world > cfg.block_size:
        raise ValueError(f"sequence length {t * world} exceeds block_size {cfg.block_size}")
    if positions is not None:
        pe = ops.embedding(wpe, positions)  # (B, T, C)
    elif context is None:
        pe = ops.embedding(wpe, torch.arange(t, device=idx.device))  # (T, C)
    else:  # wpe whole, or (on a mesh) this rank's rows of it: the rows at its global positions
        pe = context.position_rows(wpe, cfg.block_size, t)  # (T, C): this rank's T tokens
    x = ops.embedding(wte, idx) + pe  # (B, T, C)
    return rng.dropout(x, cfg.dropout, stages_lib.site_key(key, 0))


class Embedding(nn.Embedding):
    """`nn.Embedding` whose lookup is `functrain.ops.embedding` (a deterministic compiled backward)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """ids (...) -> (..., C)."""
        return ops.embedding(self.weight, idx)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate, head-major q/k/v projections."""

    context = None  # a `parallel.context.Split`: this rank holds part of each sequence (context_parallel)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # The head count comes from the tensor, so a TP-local slice of heads runs unchanged. Layers,
        # not `einops.rearrange` calls: a layer parses its pattern once, here, where torch.compile
        # would trace the parse at every call (~0.15 s of compile time each).
        self.split_heads = Rearrange("b t (h d) -> b h t d", d=self.head_dim)
        self.merge_heads = Rearrange("b h t d -> b t (h d)")

    def forward(self, x: torch.Tensor, dropout_key: torch.Tensor | None = None, packed=None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C); dropout on the output projection when a key is given; `packed`
        (`models.lm.Packed`): attention within each document only."""
        q = self.split_heads(self.q(x))  # (B, H, T, D)
        k = self.split_heads(self.k(x))  # (B, H, T, D)
        v = self.split_heads(self.v(x))  # (B, H, T, D)
        # SDPA's own dropout uses the global RNG: keep it off and drop on the projection instead.
        if packed is not None:  # block-causal (each document attends to itself only), or over a KV cache
            k, v = packed.keys_values(k, v)  # (B, H, T or L, D): L with a cache (`generation.kv_cache`)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.mask, dropout_p=0.0)  # (B, H, T, D)
        elif self.context is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)  # (B, H, T, D)
        else:  # this rank's queries over every rank's keys and values
            y = self.context.attention(q, k, v)  # (B, H, T, D)
        y = self.merge_heads(y)  # (B, T, C)
        return rng.dropout(self.proj(y), self.dropout, dropout_key)


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU -> Linear(4C, C) -> dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor, dropout_key: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        return rng.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, dropout_key)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, attn_key=None, mlp_key=None, packed=None):
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x), attn_key, packed)
        return x + self.mlp(self.ln_2(x), mlp_key)


class GPT(nn.Module):
    """GPT-2 style language model: embeddings, `n_layer` pre-LN blocks, final LayerNorm, tied head.

    Args:
      cfg: a `GPTConfig`.
      key: optional `rng` key; when given, the initial weights are a pure function of it (see
        `init_params`); when None they come from torch's global generator, as for any nn.Module.
        Under `with torch.device("meta")` nothing is initialized (a storage-free template).

    Returns (forward):
      `forward(idx, dropout_key=None)` maps int64 token ids (B, T), T <= block_size, to logits
      (B, T, vocab_size). Dropout is applied only when `dropout_key` is a key and `cfg.dropout > 0`,
      each site with its own key `rng.fold_in(dropout_key, site)`.

    Example:
      >>> with torch.device("meta"):
      ...     template = GPT(cfg)                       # shapes only, no storage
      >>> params = init_params(template, rng.key(0))    # real tensors
      >>> logits = torch.func.functional_call(template, params, (idx,))
    """

    context = None  # a `parallel.context.Split`: positions of this rank's part of each sequence

    def __init__(self, cfg: GPTConfig, key: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: named_parameters() lists it once, as wte.weight
        if not self.wte.weight.is_meta:
            with torch.no_grad():
                for name, p in self.named_parameters():  # key None: the global generator
                    p.copy_(_init_block(self, name, p.shape, key, [0] * p.ndim, list(p.shape)))

    def get_output_embeddings(self) -> nn.Linear:
        """The output layer (transformers' name for it: LoRA's "all-linear" leaves it out, as PEFT's)."""
        return self.lm_head

    def forward(
        self, idx: torch.Tensor, dropout_key: torch.Tensor | None = None, *, packed=None, return_hidden: bool = False
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size), or the final hidden states (B, T, C) after
        `ln_f` with `return_hidden=True` (for losses that apply the tied head themselves); `packed`
        (`models.lm.packed(positions)`): rows of several documents, each seeing only itself; or a
        `generation.kv_cache.Cached` view: the new tokens of rows whose earlier keys and values are cached."""
        key = stages_lib.dropout_key(self.cfg.dropout, dropout_key)
        positions = None if packed is None else packed.positions
        x = _embed(self.cfg, self.wte.weight, self.wpe.weight, idx, key, self.context, positions)  # (B, T, C)
        x = self.ln_f(stages_lib.run_blocks(self.blocks, x, key, packed))  # (B, T, C)
        return x if return_hidden else self.lm_head(x)  # (B, T, V)


GPTStages = LMStages  # embed, blocks, final: a GPT cut into `functrain.step.staged.Stage`s (see `stages`)


def stages(model: GPT) -> GPTStages:
    """`model`'s forward (up to the hidden states after `ln_f`) as stages, for activation checkpointing.

    Each stage reads only its own parameters (full names, e.g. `blocks.3.attn.q.weight`) and runs
    its submodule with `torch.func.functional_call` on them, prefix stripped, so a tensor-parallel
    copy (`functrain.parallel.tensor_parallel`, which swaps Linear modules) works unchanged. Dropout
    is the forward's: the same sites and keys, off when `cfg.dropout == 0` or the key is None. So
    `final(blocks[-1](...(embed(idx))))` equals `model(idx, dropout_key=key, return_hidden=True)`.

    Args:
      model: a `GPT` (a meta-device template is fine: the weights come from the params).

    Returns:
      `GPTStages(embed, blocks, final)`; `functrain.models.gpt.make_loss_fn(..., remat=...)` adds
      the tied head and the loss.

    Example:
      >>> st = stages(template)
      >>> h = st.embed.fn(st.embed.params(params), idx, key)
      >>> for b in st.blocks:
      ...     h = b.fn(b.params(params), h, key)
      >>> hidden = st.final.fn(st.final.params(params), h, key)
    """
    cfg = model.cfg

    def embed(p, idx, key, packed=None):
        """Token ids (B, T) -> embeddings (B, T, C), dropout site 0 (the forward's `_embed`)."""
        positions = None if packed is None else packed.positions
        key = stages_lib.dropout_key(cfg.dropout, key)
        return _embed(cfg, p["wte.weight"], p["wpe.weight"], idx, key, model.context, positions)

    names = tuple(n for n, _ in model.named_parameters() if n.startswith(("wte.", "wpe.")))
    return GPTStages(
        embed=Stage(names, embed, rows=("wpe.weight",)),  # looked up at the tokens' positions only
        blocks=stages_lib.block_stages(model, "blocks", cfg.dropout),
        final=stages_lib.norm_stage(model, "ln_f."),
    )


def _init_block(model: GPT, name: str, shape, key: torch.Tensor | None, offset, local_shape) -> torch.Tensor:
    """The block (`offset`, `local_shape`) of parameter `name`'s nanoGPT init, on CPU float32."""
    owner = model.get_submodule(name.rpartition(".")[0])
    if name.endswith("bias"):
        return torch.zeros(local_shape)
    if isinstance(owner, nn.LayerNorm):
        return torch.ones(local_shape)
    std = 0.02
    if name.endswith("proj.weight"):  # residual projections (attn.proj, mlp.proj): GPT-2 scaling
        std = 0.02 / math.sqrt(2 * model.cfg.n_layer)
    if key is None:  # the global generator (a module built without a key)
        return torch.randn(local_shape) * std
    k = rng.fold_in(key.cpu(), zlib.crc32(name.encode()))
    return rng.normal(k, shape, offset=offset, local_shape=local_shape) * std


def init_params(
    model: GPT,
    key: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    where: Callable | None = None,
) -> dict[str, torch.Tensor]:
    """Fresh nanoGPT-initialized parameters for `model` (typically a meta-device template).

    Each tensor is drawn by `rng.normal` from `rng.fold_in(key, crc32(name))`, row by row, so a
    parameter's value depends only on (key, its name, its shape): the same on every device and rank,
    whatever the other parameters are, and any block of it can be drawn alone (sharded init).
    Init: normal(0, 0.02) for embeddings and Linear weights, normal(0, 0.02 / sqrt(2 n_layer)) for
    the residual projections (`*.proj.weight`), zeros for biases, ones for LayerNorm weights.

    Args:
      model: a `GPT` (its parameters may live on "meta").
      key: an `rng` key.
      device: where to put the tensors (default CPU).
      dtype: floating dtype of the tensors.
      where: optional `where(name, shape) -> (offset, local_shape)`: draw only that block of each
        parameter (this rank's shard; `functrain.parallel.init_sharded` passes it). Default: whole.

    Returns:
      A dict name -> tensor (the block, with `where`) in `model.named_parameters()` order (the tied
      head appears once).

    Example:
      >>> with torch.device("meta"):
      ...     template = GPT(cfg)
      >>> params = init_params(template, rng.key(0), device="cuda")
    """
    return init_blocks(model, key, _init_block, device=device, dtype=dtype, where=where)


TP_RULES: list[tuple[str, str]] = [
    (r"^blocks\.\d+\.attn\.(q|k|v)\.(weight|bias)$", "colwise"),
    (r"^blocks\.\d+\.mlp\.fc\.(weight|bias)$", "colwise"),
    (r"^blocks\.\d+\.(attn|mlp)\.proj\.(weight|bias)$", "rowwise"),
    (r".*", "replicate"),
]
"""Tensor-parallel sharding rules for `GPT`, as data: ordered (regex, kind); the first
`re.search` match on a parameter name wins.

Kinds (Megatron-style, on the tensor-parallel mesh axis):
  colwise:   Linear weight Shard(0) (output features), bias Shard(0). Used for q, k, v and mlp.fc;
             because q/k/v outputs are head-major `(h d)`, each rank holds whole heads (n_head must
             divide by the TP degree).
  rowwise:   Linear weight Shard(1) (input features), bias Replicate; the output is a partial sum
             to be reduced. Used for attn.proj and mlp.proj, which consume the colwise outputs.
  replicate: everything else (embeddings, tied lm_head, LayerNorms).

Example:
    >>> kind = next(k for pat, k in TP_RULES if re.search(pat, "blocks.0.attn.q.weight"))  # "colwise"
"""


def num_params(cfg: GPTConfig, non_embedding: bool = False) -> int:
    """Number of parameters of `GPT(cfg)`, computed from the config (no model is built).

    Args:
      cfg: a `GPTConfig`.
      non_embedding: subtract the position embedding (nanoGPT's convention: the token embedding
        stays, because it is also the lm_head weight and costs a matmul).

    Returns:
      The parameter count (the tied token embedding / lm_head counted once).

    Example:
      >>> num_params(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32))
    """
    c, b = cfg.n_embd, int(cfg.bias)
    ln = c + b * c
    attn = 4 * (c * c + b * c)
    mlp = (4 * c * c + b * 4 * c) + (4 * c * c + b * c)
    n = cfg.vocab_size * c + cfg.block_size * c + cfg.n_layer * (2 * ln + attn + mlp) + ln
    return n - cfg.block_size * c if non_embedding else n


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward), the PaLM / nanoGPT MFU estimate.

    flops = 6 N + 12 L C T, with N = `num_params(cfg, non_embedding=True)` (all weights but the
    position embedding; the tied lm_head matmul is counted through the token embedding), L = n_layer,
    C = n_embd (= n_head * head_dim), T = block_size. 6 N is 2 FLOPs per multiply-add in the forward
    and twice that in the backward; 12 L C T counts the attention score and value matmuls
    (2 x 2 T C per layer forward, x3 for training) over the full context, without discounting the
    causal mask (PaLM convention).

    Args:
      cfg: a `GPTConfig`.

    Returns:
      FLOPs per trained token, as a float. MFU = flops_per_token * tokens_per_second / peak_flops.

    Example:
      >>> flops_per_token(cfg) * batch_size * cfg.block_size   # FLOPs of one optimizer step
    """
    n = num_params(cfg, non_embedding=True)
    return float(6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size)


def gpt_hidden(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    idx: torch.Tensor,
    dropout_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final hidden states (after `ln_f`) of a `functrain.models.gpt.GPT`, with `params` functionally.

    The same computation as the model's forward (dropout sites and keys included) minus the
    lm_head, so `gpt_hidden(...) @ params["wte.weight"].T` equals `apply(model, params, idx, ...)`.

    Args:
      model: a `GPT` (a meta-device template is fine).
      params: its parameters, {name: tensor} as for `functrain.apply`.
      idx: int64 token ids (B, T), T <= block_size.
      dropout_key: an `rng` key for dropout, or None.

    Returns:
      (B, T, n_embd) hidden states.

    Example:
      >>> h = gpt_hidden(template, state.params, x, key)
    """
    return lm_hidden(model, params, idx, dropout_key)  # (B, T, C)


def head_name(names) -> str:
    """The lm_head weight's name: its own entry when untied, else the tied token embedding."""
    return "lm_head.weight" if "lm_head.weight" in names else "wte.weight"


def gpt_loss(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    key: torch.Tensor | None = None,
    *,
    chunk_size: int = 0,
    ignore_index: int = -1,
) -> torch.Tensor:
    """Next-token cross-entropy of a GPT; with `chunk_size > 0` the (B, T, V) logits never exist.

    Args:
      model: a `functrain.models.gpt.GPT` (meta template is fine).
      params: its parameters.
      x: int64 input ids (B, T).
      y: int64 targets (B, T); `ignore_index` entries are skipped.
      key: dropout key (or None).
      chunk_size: 0 = plain loss over the full logits (`models.gpt.cross_entropy`);
        > 0 = `chunked_cross_entropy` with this many tokens per chunk.
      ignore_index: target value to ignore.

    Returns:
      A float32 scalar.

    Example:
      >>> loss = gpt_loss(template, params, x, y, key, chunk_size=2048)
    """
    return lm_loss(model, params, x, y, key, head=head_name(params), chunk_size=chunk_size, ignore_index=ignore_index)


def make_loss_fn(
    model: nn.Module, *, chunk_size: int = 0, ignore_index: int = -1, remat: str | int = "none", staged: bool = False
) -> Callable:
    """`loss_fn(params, (x, y), key) -> (loss, {})` of a GPT: `functrain.models.lm.make_lm_loss_fn` over its stages
    and tied head (its arguments: chunked cross-entropy, recomputed blocks, stages for per-block gathers).

    Args:
      model: the (meta-device) GPT template, or its tensor-parallel copy.
      chunk_size, ignore_index, remat, staged: as `functrain.models.lm.make_lm_loss_fn`'s.

    Returns:
      The loss function.

    Example:
      >>> step = make_train_step(make_loss_fn(template, chunk_size=1024, remat=2), optim.adamw(3e-4))
    """
    head = head_name({n for n, _ in model.named_parameters()})
    return make_lm_loss_fn(
        model,
        stages(cast(GPT, model)),
        head=head,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        remat=remat,
        staged=staged,
    )
