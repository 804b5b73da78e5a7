"""Rows of tokens scored in fixed shapes, split over the data-parallel ranks, gathered in order.

Internals: docs/internals.md "functrain.eval.scorer".

Example:
    >>> scorer = Scorer(model, batch_size=32)
    >>> logprob, greedy = scorer.score(params, rows)       # (N,) float64, (N,) bool
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from functrain import compiler, parallel
from functrain import tree as tree_lib
from functrain.eval.model import EvalModel
from functrain.eval.requests import Row
from functrain.generation.generator import Generator, Sampling, pick, request_keys

__all__ = ["Interrupted", "Scorer", "default_buckets"]


class Interrupted(Exception):
    """`Scorer.score` stopped between two batches because its `interrupt()` said so (a preemption)."""


def default_buckets(block_size: int, smallest: int = 32) -> tuple[int, ...]:
    """Powers of two from `smallest` below `block_size`, then `block_size` itself.

    Args:
      block_size: the longest input.
      smallest: the shortest bucket.

    Returns:
      Increasing lengths, the last `block_size`.

    Example:
      >>> default_buckets(200)
      (32, 64, 128, 200)
    """
    out, n = [], smallest
    while n < block_size:
        out.append(n)
        n *= 2
    return tuple(out) + (block_size,)


class Scorer:
    """Scores and extends token rows with one model, in fixed shapes (see the module docstring).

    Args:
      model: the `EvalModel`.
      batch_size: rows per forward on each rank.
      buckets: the padded lengths (default `default_buckets(model.block_size)`); the last must hold
        `model.block_size`.
      compile: compile the forward of plain (unsharded) params, one graph per bucket; sharded params
        run eagerly, a stage gathered at a time.
    """

    def __init__(
        self, model: EvalModel, *, batch_size: int = 32, buckets: Sequence[int] | None = None, compile: bool = False
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: give at least 1 row per forward")
        self.model, self.batch_size, self.compile = model, int(batch_size), bool(compile)
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(model.block_size)
        if self.buckets[-1] < model.block_size:
            raise ValueError(f"buckets {self.buckets} stop below the block size {model.block_size}")
        self._graphs: dict[tuple[str, int], Callable] = {}
        self._generators: dict[tuple[torch.dtype, int], Generator] = {}

    # -- compiled units -----------------------------------------------------------------------

    def _unit(self, kind: str, length: int, sharded: bool) -> Callable:
        """The (compiled, for plain params) forward `kind` ("score" or "next") of one bucket length."""
        fn = _score if kind == "score" else _next_logits
        if sharded or not self.compile:
            return lambda *args: fn(self.model.logits, *args)
        key = (kind, length)
        if key not in self._graphs:
            graph = compiler.graph(fn, name=f"eval_{kind}_{length}")
            logits = self.model.logits
            self._graphs[key] = lambda *args: graph(logits, *args)
        return self._graphs[key]

    def _bucket(self, n: int) -> int:
        """The smallest bucket holding an input of n tokens."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"an input of {n} tokens exceeds the largest bucket {self.buckets[-1]}")

    # -- scoring ------------------------------------------------------------------------------

    @torch.no_grad()
    def score(
        self, params, rows: Sequence[Row], model_state=None, interrupt: Callable[[], bool] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-likelihood of each row's scored targets, and whether each is the greedy choice.

        Args:
          params: the model's params (plain tensors, or DTensors: then every rank calls this).
          rows: the rows (the same list on every rank).
          model_state: the model's buffers, or None.
          interrupt: asked before each batch; True stops the scoring (`Interrupted`). Distributed, it must
            answer the same on every rank (`PreemptionFlag.requested`: agreed over ranks).

        Returns:
          (logprob (N,) float64 CPU: the sum over the scored targets of log p, computed in float32;
          greedy (N,) bool CPU: every scored target is the argmax), in `rows`' order, on every rank.

        Raises:
          Interrupted: `interrupt()` answered True.

        Example:
          >>> lp, greedy = Scorer(model).score(params, [Row([5, 6, 7], 2)])
        """
        layout = parallel.layout_of(params)
        device = _device_of(params)
        sharded = layout.sharded
        out = torch.zeros(len(rows), 2, dtype=torch.float64)  # (N, [logprob, greedy])
        plan = self._plan([len(r.tokens) - 1 for r in rows], layout)
        for length, members in plan:
            if interrupt is not None and interrupt():
                raise Interrupted
            ids, targets, mask = _pack([rows[i] for i in members if i >= 0], length, self.batch_size, device)
            logprob, greedy = self._unit("score", length, sharded)(params, model_state, ids, targets, mask)
            live = [j for j, i in enumerate(members) if i >= 0]
            if live:
                idx = torch.tensor([members[j] for j in live])
                out[idx, 0] = logprob[live].double().cpu()
                out[idx, 1] = greedy[live].double().cpu()
        out = layout.sum_over_dp(out.to(device)).cpu()
        return out[:, 0], out[:, 1] > 0.5

    def _plan(self, lengths: list[int], layout) -> list[tuple[int, list[int]]]:
        """This rank's batches: (bucket length, row indices, -1 for padding), as many on every rank."""
        order = sorted(range(len(lengths)), key=lambda i: (self._bucket(lengths[i]), i))
        batches: list[tuple[int, list[int]]] = []
        for i in order:
            b = self._bucket(lengths[i])
            if not batches or batches[-1][0] != b or len(batches[-1][1]) == self.batch_size:
                batches.append((b, []))
            batches[-1][1].append(i)
        world, rank = layout.dp_world, layout.dp_rank
        per_rank = math.ceil(len(batches) / world) if batches else 0
        mine = batches[rank::world]
        smallest = self.buckets[0]
        mine += [(smallest, [])] * (per_rank - len(mine))  # padding forwards: the ranks stay in step
        return [(b, members + [-1] * (self.batch_size - len(members))) for b, members in mine]

    # -- generation ---------------------------------------------------------------------------

    @torch.no_grad()
    def extend(
        self,
        params,
        prompts: Sequence[list[int]],
        max_new: int,
        *,
        stop: Callable[[int, list[int]], bool],
        key: torch.Tensor | None = None,
        sampling: Sampling | None = None,
        model_state=None,
    ) -> list[list[int]]:
        """Appends up to `max_new` tokens to each prompt, greedily or sampled from `key`.

        Args:
          params: the params (DTensors: every rank calls this).
          prompts: token lists (a longer one than `block_size - 1` keeps its last tokens).
          max_new: the most tokens appended to each.
          stop: `stop(request index, new tokens) -> bool`: the request is done (its stop string or EOS).
          key: an `rng` key for sampling (request i drawn as `functrain.generation`'s sample 0 of prompt i: the same
            tokens whatever the batching, the ranks or the cache); None: greedy.
          sampling: how to sample with `key` (default `Sampling()`: the softmax at temperature 1).
          model_state: the model's buffers, or None.

        Returns:
          The new tokens of each prompt, in order, on every rank.

        Example:
          >>> new = scorer.extend(params, [[5, 6]], 10, stop=lambda i, toks: False)
        """
        layout = parallel.layout_of(params)
        cached = self.model.cached
        if layout.sharded and cached is not None and cached.sharded_forward is None:
            # a model without stages (its loss unstaged): gathered whole once, as its logits and training step are
            params, layout = parallel.gather(params), parallel.LOCAL
        block = self.model.block_size
        cut = [list(p)[-(block - 1) :] if block > 1 else [] for p in prompts]  # what each row starts from
        gen = self._cache_generator(params, cut, max_new)
        new: dict[int, list[int]] = {}  # this rank's requests' new tokens
        if gen is not None:  # plain params: this rank's requests; sharded: all (the stages' gathers in step)
            mine = list(range(len(cut))) if layout.sharded else list(range(layout.dp_rank, len(cut), layout.dp_world))
            done = gen(
                params, [cut[i] for i in mine], max_new, key=key, sampling=sampling or Sampling(), stop=stop, index=mine
            )
            new = {i: c.tokens for i, [c] in zip(mine, done)}
            if layout.sharded:
                return [new[i] for i in range(len(prompts))]
        else:  # this rank's batches recomputed, a step per token over every rank's (collective counts)
            n_batches = math.ceil(len(prompts) / self.batch_size)
            mine = list(range(layout.dp_rank, n_batches, layout.dp_world))
            for slot in range(math.ceil(n_batches / layout.dp_world)):
                start = mine[slot] * self.batch_size if slot < len(mine) else len(prompts)
                members = list(range(start, min(start + self.batch_size, len(prompts))))
                batch = self._extend_batch(
                    params, model_state, cut, members, max_new, stop, key, sampling, layout, _device_of(params)
                )
                new.update(zip(members, batch))
        if layout.dp_world == 1:
            return [new[i] for i in range(len(prompts))]
        out = torch.zeros(len(prompts), max_new + 1, dtype=torch.long)  # (N, [count, tokens...])
        for i, tokens in new.items():
            out[i, 0], out[i, 1 : 1 + len(tokens)] = len(tokens), torch.tensor(tokens, dtype=torch.long)
        out = layout.sum_over_dp(out.to(_device_of(params))).cpu()
        return [out[i, 1 : 1 + int(out[i, 0])].tolist() for i in range(len(prompts))]

    def _cache_generator(self, params, prompts: list[list[int]], max_new: int) -> Generator | None:
        """The KV-cache generator `extend` runs through, or None (recompute): the model has no cache, or a prompt
        leaves no room for `max_new` tokens (every token then recomputes the window, sliding past the block). Its
        cache holds the bucket of the longest prompt plus `max_new` (a decode step reads every slot; the model's
        whole block could be far longer), one per (dtype, length), made once."""
        cached = self.model.cached
        if cached is None or max_new < 1 or not all(prompts):
            return None
        need = max(len(p) for p in prompts) + max_new - 1
        if need > self.model.block_size:
            return None
        dtype = next(t.dtype for t in params.values() if t.is_floating_point())
        length = min(self._bucket(need), self.model.block_size, cached.block_size)
        if (dtype, length) not in self._generators:
            self._generators[dtype, length] = Generator(
                cached, block_size=length, batch_size=self.batch_size, dtype=dtype, compile=self.compile
            )
        return self._generators[dtype, length]

    def _extend_batch(self, params, model_state, prompts, members, max_new, stop, key, sampling, layout, device):  # noqa: PLR0913
        """One batch's generation: a step per token until every rank's rows are done (collective count)."""
        block = self.model.block_size
        seqs = [list(prompts[i]) for i in members]  # (cut to their last block - 1 tokens by `extend`)
        new: list[list[int]] = [[] for _ in members]
        active = [True] * len(members)
        for t in range(max_new):
            left = layout.sum_over_dp(torch.tensor([float(sum(active))], device=device))
            if float(left) == 0:
                break
            windows = [s[-block:] for s in seqs] or [[0]]
            length = self._bucket(max(len(w) for w in windows))
            ids = torch.zeros(self.batch_size, length, dtype=torch.long)
            last = torch.zeros(self.batch_size, dtype=torch.long)
            for j, w in enumerate(windows):
                ids[j, : len(w)] = torch.tensor(w, dtype=torch.long)
                last[j] = len(w) - 1
            logits = (
                self._unit("next", length, layout.sharded)(params, model_state, ids.to(device), last.to(device))
                .float()
                .cpu()
            )  # (B, V)
            for j, i in enumerate(members):
                if not active[j]:
                    continue
                tok = _pick(logits[j], key, i, t, sampling or Sampling())
                seqs[j].append(tok)
                new[j].append(tok)
                active[j] = not stop(i, new[j])
        return new


def _pick(logits: torch.Tensor, key, request: int, t: int, sampling: Sampling) -> int:
    """The next token of one request: the argmax, or its draw at `t` as `functrain.generation.pick` draws it."""
    keys = None if key is None else request_keys(key, [(request, 0)])
    return int(pick(logits[None], keys, t, sampling)[0][0])


def _score(logits_fn, params, model_state, ids, targets, mask):
    """(sum of log p(target) over the masked positions (B,), all of them the argmax (B,))."""
    logits = logits_fn(params, model_state, ids).float()  # (B, T, V)
    logp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]  # (B, T)
    greedy = logits.argmax(-1) == targets  # (B, T)
    return torch.where(mask, logp, 0.0).sum(-1), (greedy | ~mask).all(-1)


def _next_logits(logits_fn, params, model_state, ids, last):
    """The logits (B, V) at each row's last position `last` (B,)."""
    logits = logits_fn(params, model_state, ids)  # (B, T, V)
    return logits[torch.arange(ids.shape[0], device=ids.device), last]


def _pack(rows: list, length: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, targets, scored mask), each (batch, length): the rows, right-padded with 0, then padding rows."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    targets = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for j, row in enumerate(rows):
        n = len(row.tokens) - 1
        ids[j, :n] = torch.tensor(row.tokens[:-1], dtype=torch.long)
        targets[j, :n] = torch.tensor(row.tokens[1:], dtype=torch.long)
        mask[j, n - row.scored : n] = True
    return ids.to(device), targets.to(device), mask.to(device)


def _device_of(params) -> torch.device:
    """Where the params compute (a DTensor's local device)."""
    leaf = next(iter(tree_lib.leaves(params)), None)
    if leaf is None:
        return torch.device("cpu")
    return (leaf.to_local() if parallel.is_dtensor(leaf) else leaf).device
