"""Generation through a KV cache: a batch of prompts prefilled once, then a compiled decode call per few tokens.

`Generator` runs a decoder whose attention reads `kv_cache.Cached` (gpt, llama) over requests as users make
them: prompts of different lengths, `n` samples each, greedy or sampled (temperature, top-k, top-p, min-p),
stopped by the model's EOS ids, a stop rule (the harness's stop strings) or `max_new_tokens`, each sampled
token returned with its log-probability. Randomness comes from the key alone: sample j of prompt i draws its
t-th token from `fold_in(fold_in(fold_in(key, i), j), t)`, so its text does not depend on the batch. The
shapes are fixed (rows padded to `batch_size`, prompts left-padded to a bucket): one prefill graph per bucket,
one decode graph (a few tokens per call: its fixed cost shared).
Internals: docs/internals.md "functrain.generation.generator".

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
        return _warp(logits, _Warp.of(self, logits.device))


class _Warp(NamedTuple):
    """A `Sampling` as a decode graph takes it: which warpers run (Python: a graph per kind) and their values
    (0-d float32 tensors: other values run the same graph)."""

    greedy: bool
    top_k: int
    temperature: torch.Tensor
    dropped: torch.Tensor | None  # 1 - top_p: the least likely mass cut (None: top_p = 1)
    min_p: torch.Tensor | None  # (None: 0)

    @classmethod
    def of(cls, s: Sampling, device) -> _Warp:
        """`s`'s warpers on `device`."""

        def value(x: float) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.float32, device=device)

        top_p, min_p = (value(1 - s.top_p) if s.top_p < 1 else None), (value(s.min_p) if s.min_p > 0 else None)
        return cls(s.greedy, s.top_k, value(s.temperature or 1.0), top_p, min_p)


def _warp(logits: torch.Tensor, w: _Warp) -> torch.Tensor:
    """`Sampling.warp`: temperature, top-k, top-p, min-p in transformers' order."""
    logits = logits / w.temperature
    if 0 < w.top_k < logits.shape[-1]:
        kth = logits.topk(w.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if w.dropped is not None:
        ascending, order = logits.sort(dim=-1)  # (B, V) each
        drop = ascending.softmax(-1).cumsum(-1) <= w.dropped
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    if w.min_p is not None:
        probs = logits.softmax(-1)  # (B, V)
        logits = logits.masked_fill(probs < w.min_p * probs.amax(-1, keepdim=True), float("-inf"))
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
      sharded_kv_heads: the kv heads a rank's cache holds under `sharded_forward` (tensor-parallel: its own
        heads), or None: `cache_shape`'s.
    """

    forward: Callable
    cache_shape: tuple[int, int, int]
    block_size: int
    sharded_forward: Callable | None = None
    sharded_kv_heads: int | None = None

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
      compile: compile the prefill (one graph per prompt bucket) and the decode step (one graph per kind of
        sampling: greedy, or the warpers asked, whatever their values).
      tokens_per_call: decode steps per call of the decode graph (default 4 compiled, 1 eager): a call's fixed
        cost (guards, the graph's wrapper) is paid once per that many tokens; the steps a call runs past a row's
        last token are dropped, so the tokens are the same at any value.
    """

    def __init__(
        self,
        model: CachedModel,
        *,
        block_size: int | None = None,
        batch_size: int = 8,
        dtype: torch.dtype = torch.float32,
        compile: bool = True,
        tokens_per_call: int | None = None,
    ):
        if batch_size < 1:
            raise GenerationError(f"batch_size={batch_size}: give at least 1 row per forward")
        if tokens_per_call is not None and tokens_per_call < 1:
            raise GenerationError(f"tokens_per_call={tokens_per_call}: give at least 1 decode step per call")
        block_size = model.block_size if block_size is None else int(block_size)
        if block_size > model.block_size:
            raise GenerationError(
                f"block_size={block_size} exceeds the model's {model.block_size}; give at most {model.block_size}"
            )
        self.model, self.block_size = model, block_size
        self.batch_size, self.dtype, self.compile = int(batch_size), dtype, bool(compile)
        self.tokens_per_call = int(tokens_per_call or (4 if compile else 1))
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
        _, sharded = self._forward_for(params)
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

    @torch.no_grad()
    def score(
        self, params: dict[str, torch.Tensor], sequences: Sequence[Sequence[int]], *, temperature: float = 1.0
    ) -> list[list[float]]:
        """The log-probability of each token of each sequence after the first, given the tokens before it: one
        forward of the sequence through the cache (a prefill, eagerly), `log_softmax(logits / temperature)`.

        Args:
          params: as for a call (plain, or DTensors: every rank scores the same sequences).
          sequences: token id lists of at least 2 tokens and at most `block_size + 1` (the last is not run).
          temperature: the logits are divided by it (> 0): the log-probs a draw at that temperature had.

        Returns:
          For each sequence, `len(sequence) - 1` log-probs.

        Raises:
          GenerationError: a sequence of under 2 tokens or over `block_size + 1`, or temperature <= 0 (one line).

        Example:
          >>> [[lp]] = gen.score(params, [[1, 2]])       # log p(2 | 1)
        """
        if temperature <= 0:
            raise GenerationError(f"temperature={temperature}: score at a temperature > 0")
        for i, seq in enumerate(sequences):
            if not 2 <= len(seq) <= self.block_size + 1:
                raise GenerationError(
                    f"sequence {i} has {len(seq)} tokens; score 2 to block_size + 1 = {self.block_size + 1} tokens"
                )
        forward, sharded = self._forward_for(params)
        device, out = next(iter(params.values())).device, []
        for start in range(0, len(sequences), self.batch_size):
            rows = [list(seq) for seq in sequences[start : start + self.batch_size]]
            length = max(len(r) for r in rows) - 1  # (the last token is not run)
            idx, pads = self._left_padded([r[:-1] for r in rows], length, device)
            cache = self._cache_for(device, sharded)
            view = cached(cache, pads, torch.arange(length, device=device))
            logits = forward(params, idx, view)[: len(rows)].float()  # (R, length, V)
            logp = (logits / temperature).log_softmax(-1)
            for b, r in enumerate(rows):
                at = logp[b, length - len(r) + 1 :]  # (len(r) - 1, V): the positions before tokens 1..
                out.append(at.gather(-1, torch.tensor(r[1:], device=device)[:, None])[:, 0].tolist())
        return out

    def _forward_for(self, params: dict[str, torch.Tensor]) -> tuple[Callable, bool]:
        """(the model's forward for `params`, whether they are DTensors): its sharded forward for DTensors (one line
        where this model decodes from plain params only)."""
        if not any(parallel.is_dtensor(t) for t in params.values()):
            return self.model.forward, False
        if self.model.sharded_forward is None:
            raise GenerationError(
                "the params are sharded (DTensors) and this model decodes from plain params only; gather them "
                "(functrain.parallel.gather) or generate with models.inference.generate(..., stages=...)"
            )
        return self.model.sharded_forward, True

    def _left_padded(self, rows: Sequence[Sequence[int]], length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (B, length), pads (B,)) on `device`: the rows left-padded to `length`, then padding rows of one token
        up to the cache's `batch_size` rows."""
        idx = torch.zeros(self.batch_size, length, dtype=torch.long)
        pads = torch.full((self.batch_size,), length - 1, dtype=torch.long)  # padding rows: one token
        for b, r in enumerate(rows):
            idx[b, length - len(r) :] = torch.tensor(list(r), dtype=torch.long)  # left-padded
            pads[b] = length - len(r)
        return idx.to(device), pads.to(device)

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

    def _cache_for(self, device, sharded: bool) -> KVCache:
        """The batch's cache (made once, reused: the decode graph keeps its shapes); sharded params: this rank's
        kv heads."""
        layers, heads, head_dim = self.model.cache_shape
        heads = (self.model.sharded_kv_heads or heads) if sharded else heads
        cache = self._cache
        if cache is None or cache.keys[0].device != torch.device(device) or cache.keys[0].shape[1] != heads:
            cache = self._cache = KVCache.empty(
                layers=layers,
                batch=self.batch_size,
                kv_heads=heads,
                length=self.block_size,
                head_dim=head_dim,
                dtype=self.dtype,
                device=device,
            )
        return cache

    def _batch(self, params, prompts, rows, asked: _Asked):
        """The completions of one batch of rows: prefill, then `k` decode steps per call until every row is done."""
        device, max_new, key, stop = next(iter(params.values())).device, asked.max_new, asked.key, asked.stop
        length = self._length(max(len(p) for p in prompts), max_new)
        idx, pads = self._left_padded(prompts, length, device)
        keys = None
        if key is not None and not asked.sampling.greedy:  # (padding rows: the first row's key)
            keys = request_keys(key.to(device), rows + [rows[0]] * (self.batch_size - len(rows)))
        cache = self._cache_for(device, asked.sharded)
        forward = self.model.sharded_forward if asked.sharded else self.model.forward
        eager = asked.sharded or not self.compile
        decode, k = (_decode, 1) if asked.sharded else (self._decode, self.tokens_per_call)
        logits = self._prefill(length, asked.sharded)(forward, params, cache, idx, pads)  # (B, V): after each prompt
        warp, new = _Warp.of(asked.sampling, device), [_Completing() for _ in rows]
        pending = None  # eager: the previous call's last token, run only once the run goes on
        for t in range(0, max_new, k):
            slot, index = torch.tensor(length + t, device=device), torch.tensor(t, device=device)  # (the first step's)
            if pending is not None:
                logits = _advance(forward, params, cache, pads, slot - 1, pending)
            steps = min(k, max_new - t) if eager else k  # (a graph keeps its one `k`)
            tokens, logprobs, logits = decode(
                forward, params, cache, logits, pads, slot, keys, index, warp, steps, not eager
            )
            pending = tokens[:, -1] if eager else None
            for b, (toks, lps) in enumerate(zip(tokens.tolist()[: len(rows)], logprobs.tolist())):
                for tok, lp in zip(toks[: max_new - t], lps):
                    if not new[b].finish:
                        stops = tok in asked.eos or (stop is not None and stop(rows[b].i, new[b].tokens + [tok]))
                        new[b].add(tok, lp, stops)
            if all(c.finish for c in new):
                break
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
    return forward(params, idx, cached(cache, pads, slots))[:, -1].float().contiguous()  # (B, V): one layout


def _decode(forward, params, cache: KVCache, logits, pads, slot, keys, t, warp: _Warp, k: int, last: bool = True):  # noqa: PLR0913
    """`k` decode steps: each row's next token picked from `logits` (drawn as new token `t + j`), run through the
    cache at `slot + j` (0-d tensors: no recompile), giving the next logits; `last=False` leaves the last token
    unrun (logits None). Returns tokens (B, k), log-probs (B, k), logits (B, V)."""
    tokens, logprobs = [], []
    for j in range(k):
        token, logprob = _pick(logits, keys, t + j, warp)  # (B,) each
        tokens.append(token)
        logprobs.append(logprob)
        logits = _advance(forward, params, cache, pads, slot + j, token) if last or j < k - 1 else None
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), logits


def _advance(forward, params, cache: KVCache, pads, slot, token):
    """`token` (B,) run through the cache at `slot` (at most the last slot, which only steps past every request's
    last token reach): the next logits (B, V)."""
    view = cached(cache, pads, slot.clamp(max=cache.keys[0].shape[2] - 1)[None])
    return forward(params, token[:, None], view)[:, -1].float()  # (B, V)


def request_keys(key: torch.Tensor, requests: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The keys (R, key) of `requests` [(prompt i, sample j), ...]: `fold_in(fold_in(key, i), j)` each.

    Example:
      >>> keys = request_keys(rng.key(0), [(0, 0), (0, 1), (1, 0)])
    """
    i, j = torch.tensor([[i & 0xFFFFFFFF, j & 0xFFFFFFFF] for i, j in requests], device=key.device).reshape(-1, 2).T
    return rng.fold_in(rng.fold_in(key, i), j)  # (R, key): fold_in broadcasts over the data


def pick(logits: torch.Tensor, keys: torch.Tensor | None, t: int | torch.Tensor, sampling: Sampling):
    """The next token of each row and its log-probability under `logits`: the argmax, or a Gumbel-max draw.

    Args:
      logits: (B, V) float.
      keys: (B, key) each row's key (`request_keys`), or None: greedy.
      t: the token's index among the new ones, an int or a 0-d tensor (row b's noise is
        `rng.uniform(fold_in(keys[b], t), (V,))`).
      sampling: how the logits are warped before the draw.

    Returns:
      (tokens (B,), log-probabilities (B,): `logits.log_softmax(-1)` at the tokens, before any warping).

    Example:
      >>> tokens, logprobs = pick(logits, request_keys(key, [(0, 0)]), 0, Sampling(temperature=0.8))
    """
    return _pick(logits, keys, t, _Warp.of(sampling, logits.device))


def _pick(logits: torch.Tensor, keys: torch.Tensor | None, t, w: _Warp):
    """`pick` with the warpers as a decode graph takes them (`t` an int or a 0-d tensor)."""
    logp = logits.log_softmax(-1)  # (B, V)
    if keys is None or w.greedy:
        tokens = logits.argmax(-1)  # (B,)
    else:
        u = torch.vmap(lambda k: rng.uniform(rng.fold_in(k, t), logits.shape[-1:]))(keys)  # (B, V)
        gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
        tokens = (_warp(logits, w) + gumbel).argmax(-1)  # (B,)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
