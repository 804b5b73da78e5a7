"""The three calls of lm-evaluation-harness's model interface, on functrain params.

Internals: docs/internals.md "functrain.eval.calls".

Example:
    >>> model = inference.eval_model(template, gpt.stages(template), "wte.weight", tok, block_size=128)
    >>> loglikelihood(model, params, [("def add(a, b):\n", "    return a + b")])
    [(-4.21, True)]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from functrain.eval.model import EvalModel
from functrain.eval.requests import pair_row, rolling_rows
from functrain.eval.scorer import Scorer
from functrain.generation.generator import Sampling

__all__ = ["generate_until", "loglikelihood", "loglikelihood_rolling"]

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default `max_gen_toks`


def _scorer(model: EvalModel, scorer: Scorer | None) -> Scorer:
    """The given scorer, else an eager one with the default batch and buckets."""
    return scorer if scorer is not None else Scorer(model)


def loglikelihood(
    model: EvalModel, params, requests: Sequence[tuple[str, str]], *, model_state=None, scorer: Scorer | None = None
) -> list[tuple[float, bool]]:
    """log p(continuation | context) of each request, and whether the continuation is the greedy one.

    Args:
      model: the `EvalModel`.
      params: its params (DTensors: every rank calls this with the same requests).
      requests: (context, continuation) pairs, encoded as the harness does (`requests.encode_pair`).
      model_state: the model's buffers, or None.
      scorer: the `Scorer` to run on (its batch, buckets and compiled graphs); default an eager one.

    Returns:
      [(logprob, is_greedy)], in the requests' order, on every rank.

    Raises:
      ValueError: a continuation that encodes to no tokens or exceeds the block (one line).

    Example:
      >>> loglikelihood(model, params, [("The capital of France is", " Paris")])
    """
    rows = [
        pair_row(model.tokenizer, c, x, prefix_id=model.prefix_id, block_size=model.block_size) for c, x in requests
    ]
    logprob, greedy = _scorer(model, scorer).score(params, rows, model_state)
    return [(float(lp), bool(g)) for lp, g in zip(logprob, greedy)]


def loglikelihood_rolling(
    model: EvalModel, params, texts: Sequence[str], *, model_state=None, scorer: Scorer | None = None
) -> list[float]:
    """The log-likelihood of each whole text, every token predicted once (perplexity tasks).

    Args:
      model: the `EvalModel`.
      params: its params (DTensors: every rank calls this).
      texts: the strings.
      model_state: the model's buffers, or None.
      scorer: the `Scorer` to run on.

    Returns:
      [logprob] per text, the sum over its disjoint windows (`requests.rolling_rows`).

    Example:
      >>> loglikelihood_rolling(model, params, [open("LICENSE").read()])
    """
    rows, owner = [], []
    for i, text in enumerate(texts):
        windows = rolling_rows(model.tokenizer, text, prefix_id=model.prefix_id, block_size=model.block_size)
        rows += windows
        owner += [i] * len(windows)
    logprob, _ = _scorer(model, scorer).score(params, rows, model_state)
    totals = (
        torch.zeros(len(texts), dtype=torch.float64).index_add_(0, torch.tensor(owner, dtype=torch.long), logprob)
        if rows
        else torch.zeros(len(texts), dtype=torch.float64)
    )
    return totals.tolist()


def generate_until(
    model: EvalModel,
    params,
    requests: Sequence[tuple[str, dict]],
    *,
    key: torch.Tensor | None = None,
    model_state=None,
    scorer: Scorer | None = None,
) -> list[str]:
    """The text generated after each context, cut at its first stop string.

    Args:
      model: the `EvalModel`.
      params: its params (DTensors: every rank calls this).
      requests: (context, options) pairs, options as the harness's `gen_kwargs`: `until` (a string or
        a list; the end-of-text token and the model's other stop ids, generation_config.json's, always
        stop), `max_gen_toks` (default 256), `do_sample` (with
        `do_sample=True`, which needs `key`, the tokens are sampled at `temperature` (default 1) from the
        `top_k` most likely (0: all) within the `top_p` probability mass, as transformers' logits warpers
        define them; else greedy, as HFLM).
      key: an `rng` key for sampled requests (request i's tokens drawn as `functrain.generation` draws prompt i).
      model_state: the model's buffers, or None.
      scorer: the `Scorer` to run on.

    Returns:
      The continuations, in order; each context keeps its last `block_size - max_gen_toks` tokens.

    Raises:
      ValueError: sampling asked without a key, an option this function does not support, or a value out of
        range (one line naming it).

    Example:
      >>> generate_until(model, params, [("def f(x):\\n", {"until": ["\\n\\n"], "max_gen_toks": 64})])
    """
    scorer = _scorer(model, scorer)
    tok = model.tokenizer
    stop_ids = set(getattr(getattr(tok, "special", None), "stop_ids", ())) | ({model.eos_id} - {None})
    options = [_options(o) for _, o in requests]
    sampling = [o["do_sample"] for o in options]  # as transformers' generate: no do_sample, greedy
    if any(sampling) and key is None:
        raise ValueError("generate_until: a request samples (do_sample=True); pass key= for its draws")
    texts: list[str] = [""] * len(requests)
    groups: dict[tuple, list[int]] = {}  # one generation per (max tokens, sampling)
    for i, o in enumerate(options):
        how = Sampling(o["temperature"] or 1.0, o["top_k"], o["top_p"]) if sampling[i] else None
        groups.setdefault((o["max_gen_toks"], how), []).append(i)
    for (max_new, how), members in groups.items():
        keep = max(1, model.block_size - max_new)
        prompts = [[int(t) for t in tok.encode(requests[i][0])][-keep:] or [model.prefix_id] for i in members]
        stops = [options[i]["until"] for i in members]

        def done(j: int, new: list[int], stops: list = stops) -> bool:
            """Request j's new tokens end in a stop id (EOS, generation_config.json's) or hold a stop string."""
            return new[-1] in stop_ids or any(s in tok.decode(new) for s in stops[j])

        new = scorer.extend(
            params, prompts, max_new, stop=done, key=key if how else None, sampling=how, model_state=model_state
        )
        for j, i in enumerate(members):
            texts[i] = _cut(tok.decode(new[j]), stops[j])
    return texts


def _options(gen_kwargs: dict) -> dict:
    """The harness's generation options with their defaults; unknown ones and values out of range refused."""
    known = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}
    unknown = sorted(set(gen_kwargs) - known)
    if unknown:
        raise ValueError(f"generate_until: options {unknown} are not supported; use {sorted(known)}")
    until = gen_kwargs.get("until") or []
    max_new, top_k = int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)), int(gen_kwargs.get("top_k") or 0)
    temperature = float(gen_kwargs.get("temperature") or 0.0)
    top_p = float(gen_kwargs["top_p"]) if gen_kwargs.get("top_p") is not None else 1.0
    for name, ok, valid in (
        ("max_gen_toks", max_new >= 1, ">= 1"),
        ("temperature", temperature >= 0, ">= 0"),
        ("top_k", top_k >= 0, ">= 0 (0: every token)"),
        ("top_p", 0 < top_p <= 1, "in (0, 1]"),
    ):
        if not ok:
            raise ValueError(f"generate_until: {name}={gen_kwargs[name]!r} is out of range; give a value {valid}")
    return {
        "until": [until] if isinstance(until, str) else list(until),
        "max_gen_toks": max_new,
        "do_sample": bool(gen_kwargs.get("do_sample", False)),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
    }


def _cut(text: str, stops: list[str]) -> str:
    """`text` up to its first stop string (the harness splits at each in turn)."""
    for s in stops:
        if s:
            text = text.split(s)[0]
    return text
