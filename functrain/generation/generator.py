"""Generation through a KV cache: a batch of prompts prefilled once, then one compiled decode step per token.

`Generator` runs a decoder whose attention reads `kv_cache.Cached` (gpt, llama) over requests as users make
them: prompts of different lengths, `n` samples each, greedy or sampled (temperature, top-k, top-p, min-p),
stopped by the model's EOS ids, a stop rule (the harness's stop strings) or `max_new_tokens`, each sampled
token returned with its log-probability. Randomness comes from the key alone: sample j of prompt i draws its
t-th token from `fold_in(fold_in(fold_in(key, i), j), t)`, so its text does not depend on the batch. The
shapes are fixed (rows padded to `batch_size`, prompts left-padded to a bucket): one prefill graph per bucket,
one decode graph. Internals: docs/internals.md "functrain.generation.generator".

Example:
    >>> gen = Generator.of(template, batch_size=8)
    >>> [[done]] = gen(params, [tok.encode("def ")], 64, key=rng.key(0), sampling=Sampling(temperature=0.8))
    >>> tok.decode(done.tokens), done.finish_reason
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from functrain import compiler, functional, parallel, rng
from functrain.errors import FunctrainError
from functrain.generation.kv_cache import KVCache, cached

__all__ = [
    "CachedModel",
    "Completion",
    "GenerationError",
    "Generator",
    "Sampling",
    "pick",
    "request_keys",
]


class GenerationError(FunctrainError, ValueError):
    """A request that cannot be generated (one line: what is wrong and what to change)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at `temperature=0`, else a draw from the warped distribution.

    The logits are divided by `temperature`, then cut to the `top_k` most likely tokens (0: all), to the smallest
    set holding `top_p` of the probability, and to the tokens at least `min_p` times as likely as the most likely
    one: transformers' warpers, in its order.

    Example:
      >>> Sampling(temperature=0.7, top_p=0.9)
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        bad = (
            ("temperature", self.temperature, "a value >= 0 (0: greedy)", self.temperature < 0),
            ("top_k", self.top_k, "a count >= 0 (0: every token)", self.top_k < 0),
            ("top_p", self.top_p, "a value in (0, 1]", not 0 < self.top_p <= 1),
            ("min_p", self.min_p, "a value in [0, 1]", not 0 <= self.min_p <= 1),
        )
        for name, value, want, wrong in bad:
            if wrong:
                raise GenerationError(f"sampling {name}={value} is out of range; give {want}")

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken (temperature 0)."""
        return self.temperature == 0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) float logits warped (-inf outside what may be drawn).

        Example:
          >>> Sampling(top_k=50).warp(logits)
        """
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            ascending, order = logits.sort(dim=-1)  # (B, V) each
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[:, -1] = False  # the most likely token always stays
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        if self.min_p > 0:
            probs = logits.softmax(-1)  # (B, V)
            logits = logits.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), float("-inf"))
        return logits


class Completion(NamedTuple):
    """One sample of one prompt.

    Attributes:
      tokens: the new token ids (the stop token included: an EOS id or the token that completed a stop rule).
      logprobs: each new token's log-probability under the model (its log-softmax, before any warping).
      finish_reason: "stop" (an EOS id or the stop rule) or "length" (`max_new_tokens` reached).
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


class _Row(NamedTuple):
    """One row of a batch: request `i`'s sample `j`."""

    i: int
    j: int


class _Asked(NamedTuple):
    """What one call asks of every batch: new tokens, the draws, when a row stops, and the forward's route."""

    max_new: int
    key: torch.Tensor | None
    sampling: Sampling
    eos: frozenset
    stop: Callable | None
    sharded: bool  # DTensor params: the model's sharded_forward, eagerly (a gather per stage per token)


def _buckets(block_size: int, smallest: int = 16) -> tuple[int, ...]:
    """Prompt lengths the prefill is padded to: powers of two from `smallest`, then `block_size`."""
    out = [b for b in (smallest << k for k in range(32)) if b < block_size]
    return (*out, block_size)


class CachedModel(NamedTuple):
    """A decoder that attends through a KV cache.

    Attributes:
      forward: `forward(params, idx, view) -> logits (B, T, V)`: the model on token ids (B, T) with the cache view
        (`kv_cache.Cached`) where training passes `lm.Packed`.
      cache_shape: `(layers, kv heads, head dim)` of its attention.
      block_size: the longest sequence its positions take.
      sharded_forward: the same on DTensor params, gathering one stage at a time (no rank holds the whole model;
        `models.inference.cached_model`), or None: the model decodes from plain params only.
    """

    forward: Callable
    cache_shape: tuple[int, int, int]
    block_size: int
    sharded_forward: Callable | None = None

    @classmethod
    def of(cls, template: torch.nn.Module) -> CachedModel:
        """A gpt or llama template's (its `cfg`: layers, kv heads, head dim, block size).

        Example:
          >>> CachedModel.of(template).cache_shape
          (2, 4, 16)
        """
        cfg: Any = template.cfg  # (a family's config dataclass)
        heads = int(getattr(cfg, "n_kv_head", cfg.n_head))
        head_dim = int(getattr(cfg, "head_dim", cfg.n_embd // cfg.n_head))
        return cls(
            lambda params, idx, view: functional.apply(template, params, idx, packed=view, train=False),
            (int(cfg.n_layer), heads, head_dim),
            int(cfg.block_size),
        )


class Generator:
    """Generates from a decoder through a KV cache, in fixed shapes (see the module docstring).

    Args:
      model: the `CachedModel`.
      block_size: the longest sequence (a prompt and its new tokens) the cache holds: its slots per row. A decode
        step attends over every slot, so size it to the requests (transformers' static cache takes the prompt
        plus `max_new_tokens`); default and at most the model's.
      batch_size: rows per forward (a call's rows are padded to it: one decode graph).
      dtype: the cache's dtype (the params' compute dtype).
      compile: compile the prefill (one graph per prompt bucket) and the decode step (one graph).
    """

    def __init__(
        self,
        model: CachedModel,
        *,
        block_size: int | None = None,
        batch_size: int = 8,
        dtype: torch.dtype = torch.float32,
        compile: bool = True,
    ):
        if batch_size < 1:
            raise GenerationError(f"batch_size={batch_size}: give at least 1 row per forward")
        block_size = model.block_size if block_size is None else int(block_size)
        if block_size > model.block_size:
            raise GenerationError(
                f"block_size={block_size} exceeds the model's {model.block_size}; give at most {model.block_size}"
            )
        self.model, self.block_size = model, block_size
        self.batch_size, self.dtype, self.compile = int(batch_size), dtype, bool(compile)
        self.buckets = _buckets(self.block_size)
        self._prefills: dict[int, Callable] = {}  # padded prompt length -> its prefill (compiled: one graph each)
        self._decode = compiler.graph(_decode, name="decode") if compile else _decode
        self._cache: KVCache | None = None

    @classmethod
    def of(cls, template: torch.nn.Module, **kwargs: Any) -> Generator:
        """The generator of a gpt or llama template (`CachedModel.of`); `kwargs` as the constructor's.

        Example:
          >>> gen = Generator.of(template, batch_size=16)
        """
        return cls(CachedModel.of(template), **kwargs)

    @torch.no_grad()
    def __call__(  # noqa: PLR0913 (a request's options)
        self,
        params: dict[str, torch.Tensor],
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        key: torch.Tensor | None = None,
        sampling: Sampling = Sampling(),
        n: int = 1,
        eos_ids: Sequence[int] = (),
        stop: Callable[[int, list[int]], bool] | None = None,
        index: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """`n` completions of every prompt.

        Args:
          params: the model's params: plain tensors, or DTensors (where the model has a `sharded_forward`: every
            rank calls with the same requests, eagerly, and gets the same completions).
          prompts: token id lists, each of at least one token.
          max_new_tokens: the most tokens appended to each.
          key: an `rng` key; None: greedy whatever `sampling` says.
          sampling: how tokens are drawn.
          n: samples per prompt.
          eos_ids: every id that ends a completion (the model's EOS ids).
          stop: `stop(request index, new tokens) -> bool`: the completion is done (e.g. a stop string appeared).
          index: each prompt's request index (its draws' `fold_in` and `stop`'s first argument; default its place
            in `prompts`): a rank's share of a larger batch draws as in the whole batch.

        Returns:
          For each prompt, its `n` `Completion`s.

        Raises:
          GenerationError: an empty prompt, `max_new_tokens < 1`, `n < 1`, a prompt that leaves no room for
            `max_new_tokens` within `block_size`, or sharded params the model cannot decode from (one line).

        Example:
          >>> [[c]] = gen(params, [[1, 2, 3]], 16)        # greedy
        """
        self._check(prompts, max_new_tokens, n)
        sharded = any(parallel.is_dtensor(t) for t in params.values())
        if sharded and self.model.sharded_forward is None:
            raise GenerationError(
                "the params are sharded (DTensors) and this model decodes from plain params only; gather them "
                "(functrain.parallel.gather) or generate with models.inference.generate(..., stages=...)"
            )
        asked = _Asked(max_new_tokens, key, sampling, frozenset(int(e) for e in eos_ids), stop, sharded)
        ids = list(range(len(prompts))) if index is None else [int(i) for i in index]
        text = dict(zip(ids, prompts))
        rows = [_Row(i, j) for i in ids for j in range(n)]
        out: dict[_Row, Completion] = {}
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            texts = [text[r.i] for r in batch]
            out.update(zip(batch, self._batch(params, texts, batch, asked)))
        return [[out[_Row(i, j)] for j in range(n)] for i in ids]

    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, n: int) -> None:
        """One `GenerationError` line for a request that cannot run."""
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens={max_new_tokens}: ask for at least 1 new token")
        if n < 1:
            raise GenerationError(f"n={n}: ask for at least 1 sample per prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise GenerationError(
                    f"prompt {i} is empty; start it with a token (the tokenizer's BOS, when it has one)"
                )
            if len(p) + max_new_tokens - 1 > self.block_size:
                raise GenerationError(
                    f"prompt {i} has {len(p)} tokens: with max_new_tokens={max_new_tokens} it exceeds the cache's "
                    f"block_size {self.block_size}; shorten the prompt, ask for fewer new tokens or give the "
                    "Generator a larger block_size (at most the model's)"
                )

    def _length(self, longest: int, max_new_tokens: int) -> int:
        """The padded prompt length: the smallest bucket holding `longest`, or what the cache leaves room for."""
        bucket = next(b for b in self.buckets if b >= longest)
        return min(bucket, self.block_size - max_new_tokens + 1)

    def _prefill(self, length: int, sharded: bool) -> Callable:
        """The prefill of prompts padded to `length` (compiled, for plain params: a graph of its own per length)."""
        if sharded:
            return _prefill
        if length not in self._prefills:
            self._prefills[length] = compiler.graph(_prefill, name=f"prefill_{length}") if self.compile else _prefill
        return self._prefills[length]

    def _cache_for(self, device) -> KVCache:
        """The batch's cache (made once, reused: the decode graph keeps its shapes)."""
        if self._cache is None or self._cache.keys[0].device != torch.device(device):
            layers, heads, head_dim = self.model.cache_shape
            self._cache = KVCache.empty(
                layers=layers,
                batch=self.batch_size,
                kv_heads=heads,
                length=self.block_size,
                head_dim=head_dim,
                dtype=self.dtype,
                device=device,
            )
        return self._cache

    def _batch(self, params, prompts, rows, asked: _Asked):
        """The completions of one batch of rows: prefill, then a decode step per token until every row is done."""
        device, max_new, key, stop = next(iter(params.values())).device, asked.max_new, asked.key, asked.stop
        length = self._length(max(len(p) for p in prompts), max_new)
        idx = torch.zeros(self.batch_size, length, dtype=torch.long)
        pads = torch.full((self.batch_size,), length - 1, dtype=torch.long)  # padding rows: one token
        for b, p in enumerate(prompts):
            idx[b, length - len(p) :] = torch.tensor(list(p), dtype=torch.long)  # left-padded
            pads[b] = length - len(p)
        idx, pads = idx.to(device), pads.to(device)
        keys = None
        if key is not None and not asked.sampling.greedy:  # (padding rows: the first row's key)
            keys = request_keys(key.to(device), rows + [rows[0]] * (self.batch_size - len(rows)))
        cache = self._cache_for(device)
        forward = self.model.sharded_forward if asked.sharded else self.model.forward
        decode = _decode if asked.sharded else self._decode
        logits = self._prefill(length, asked.sharded)(forward, params, cache, idx, pads)  # (B, V): after each prompt
        new = [_Completing() for _ in rows]
        for t in range(max_new):
            tokens, logprobs = pick(logits, keys, t, asked.sampling)  # (B,) each
            for b, (tok, lp) in enumerate(zip(tokens.tolist()[: len(rows)], logprobs.tolist())):
                if not new[b].finish:
                    stops = tok in asked.eos or (stop is not None and stop(rows[b].i, new[b].tokens + [tok]))
                    new[b].add(tok, lp, stops)
            if all(c.finish for c in new) or t == max_new - 1:
                break
            slot = torch.tensor(length + t, device=device)
            logits = decode(forward, params, cache, tokens[:, None], pads, slot)  # (B, V)
        return [c.completion() for c in new]


class _Completing:
    """A completion being generated."""

    def __init__(self):
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish = ""

    def add(self, token: int, logprob: float, stops: bool) -> None:
        """Appends a token; `stops`: it ends the completion."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.finish = "stop" if stops else ""

    def completion(self) -> Completion:
        """The finished `Completion` ("length" when nothing stopped it)."""
        return Completion(self.tokens, self.logprobs, self.finish or "length")


def _prefill(forward, params, cache: KVCache, idx: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """The prompts (B, P) into the cache's slots 0..P-1; the logits (B, V) after each row's last token."""
    slots = torch.arange(idx.shape[1], device=idx.device)  # (P,)
    return forward(params, idx, cached(cache, pads, slots))[:, -1].float()  # (B, V)


def _decode(forward, params, cache: KVCache, tokens: torch.Tensor, pads: torch.Tensor, slot: torch.Tensor):
    """One token per row (B, 1) into the cache at `slot` (a 0-d tensor: no recompile); the logits (B, V) after it."""
    return forward(params, tokens, cached(cache, pads, slot[None]))[:, -1].float()  # (B, V)


def request_keys(key: torch.Tensor, requests: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The keys (R, key) of `requests` [(prompt i, sample j), ...]: `fold_in(fold_in(key, i), j)` each.

    Example:
      >>> keys = request_keys(rng.key(0), [(0, 0), (0, 1), (1, 0)])
    """
    return torch.stack([rng.fold_in(rng.fold_in(key, i), j) for i, j in requests])


def pick(logits: torch.Tensor, keys: torch.Tensor | None, t: int, sampling: Sampling):
    """The next token of each row and its log-probability under `logits`: the argmax, or a Gumbel-max draw.

    Args:
      logits: (B, V) float.
      keys: (B, key) each row's key (`request_keys`), or None: greedy.
      t: the token's index among the new ones (row b's noise is `rng.uniform(fold_in(keys[b], t), (V,))`).
      sampling: how the logits are warped before the draw.

    Returns:
      (tokens (B,), log-probabilities (B,): `logits.log_softmax(-1)` at the tokens, before any warping).

    Example:
      >>> tokens, logprobs = pick(logits, request_keys(key, [(0, 0)]), 0, Sampling(temperature=0.8))
    """
    logp = logits.log_softmax(-1)  # (B, V)
    if keys is None or sampling.greedy:
        tokens = logits.argmax(-1)  # (B,)
    else:
        u = torch.vmap(lambda k: rng.uniform(rng.fold_in(k, t), logits.shape[-1:]))(keys)  # (B, V)
        gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
        tokens = (sampling.warp(logits) + gumbel).argmax(-1)  # (B,)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
