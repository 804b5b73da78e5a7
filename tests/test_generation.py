"""Generation through the KV cache (`functrain.generation.generator`) against transformers' `generate`, a full forward,
the recompute path, and itself under other batchings; its compile contract and its one-line refusals."""

from __future__ import annotations

import re
import types

import pytest
import torch
from _tol import assert_close, rtol

from functrain import functional, generation, rng
from functrain.generation import GenerationError, Generator, Sampling
from functrain.interop.hf import save_hf_directory
from functrain.models import gpt, inference, llama

V, BLOCK = 97, 96
# 8 prompts of different lengths (3..17 tokens)
PROMPTS = [[(7 * i + 3 * k) % (V - 1) + 1 for k in range(3 + 2 * i)] for i in range(8)]


def _spread(params: dict) -> dict:
    """Weights 8x the init's scale: confident logits, so a greedy pick is never a near-tie of float rounding."""
    return {n: t * 8 if t.ndim == 2 else t for n, t in params.items()}


def _gpt(block: int = BLOCK):
    cfg = gpt.GPTConfig(vocab_size=V, block_size=block, n_layer=2, n_head=4, n_embd=32)
    with torch.device("meta"):
        template = gpt.GPT(cfg)
    return template, cfg, _spread(gpt.init_params(template, rng.key(1)))


def _llama():
    cfg = llama.LlamaConfig(
        vocab_size=V, block_size=BLOCK, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64
    )
    with torch.device("meta"):
        template = llama.Llama(cfg)
    return template, cfg, _spread(llama.init_params(template, rng.key(2)))


def _transformers(tmp_path, family, cfg, params):
    """transformers' own model of the family's export."""
    transformers = pytest.importorskip("transformers")
    if family == "gpt":
        state, config = gpt.export_hf_gpt2(params, cfg), gpt.hf_gpt2_config(cfg)
    else:
        state, config = llama.export_hf_llama(params, cfg), llama.hf_llama_config(cfg)
    out = save_hf_directory(tmp_path / "export", state, config)
    return transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


def _left_padded(prompts):
    """(ids, attention mask), each (B, longest): the prompts left-padded with 0."""
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p) :], mask[b, longest - len(p) :] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_greedy_equals_transformers_generate_token_for_token(tmp_path, family):
    """8 prompts of different lengths, 64 new tokens, one batch: transformers' greedy `generate` (left-padded,
    dynamic cache) and ours give the same tokens; every log-prob equals a full forward's log-softmax."""
    template, cfg, params = _gpt() if family == "gpt" else _llama()
    theirs = _transformers(tmp_path, family, cfg, params)
    ids, mask = _left_padded(PROMPTS)
    with torch.no_grad():
        want = theirs.generate(
            ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0
        )[:, ids.shape[1] :]
    out = Generator.of(template, batch_size=8, compile=False)(params, PROMPTS, 64)
    assert [c.tokens for [c] in out] == want.tolist()
    assert all(c.finish_reason == "length" and len(c.logprobs) == 64 for [c] in out)
    for p, [c] in zip(PROMPTS, out):
        logits = functional.apply(template, params, torch.tensor([p + c.tokens]), train=False)[0]  # (T, V)
        full = logits.float().log_softmax(-1)[len(p) - 1 : -1].gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
        assert_close(torch.tensor(c.logprobs), full, rtol(cfg.n_embd * cfg.n_layer * BLOCK))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_equals_a_full_forwards_log_softmax_and_the_samplers_log_probs(temperature):
    """`Generator.score` of sampled sequences (prompts of different lengths, over two batches of rows, the last
    partly filled): each token's log-prob is the full forward's `log_softmax(logits / temperature)`; at temperature
    1 the log-probs the sampler returned with the tokens."""
    template, cfg, params = _gpt()
    gen = Generator.of(template, batch_size=3, compile=False)
    out = gen(params, PROMPTS[:4], 12, key=rng.key(4), sampling=Sampling(temperature))
    sequences = [p + c.tokens for p, [c] in zip(PROMPTS[:4], out)]
    scored = gen.score(params, sequences, temperature=temperature)
    tol = rtol(cfg.n_embd * cfg.n_layer * BLOCK)
    for seq, got, [c] in zip(sequences, scored, out):
        logits = functional.apply(template, params, torch.tensor([seq]), train=False)[0].float()  # (T, V)
        full = (logits / temperature).log_softmax(-1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        assert len(got) == len(seq) - 1
        assert_close(torch.tensor(got), full, tol)
        if temperature == 1.0:
            assert_close(torch.tensor(got[-len(c.tokens) :]), torch.tensor(c.logprobs), tol)
    with pytest.raises(GenerationError, match="sequence 0 has 1 tokens; score 2 to block_size"):
        gen.score(params, [[5]])


# the hf family's types: rotary and grouped heads, gpt2's Conv1D and learned positions, sliding windows (8
# positions: the 64 new tokens run far past them), gemma2's soft-capping and alternating windows, phi3's fused qkv
HF_TYPES = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "gpt2": {},
    "mistral": dict(sliding_window=8),
    "gemma2": dict(sliding_window=8),
    "phi3": {},
}


def _hf(tmp_path, model_type: str):
    """(template, params, transformers' own model on those params) of a tiny `model_type`."""
    transformers = pytest.importorskip("transformers")
    from functrain.models import hf
    from functrain.models.hf.tiny import write_tiny

    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    shape.update(bos_token_id=None, eos_token_id=None)  # (no EOS: `generate` runs the 64 tokens as ours does)
    directory = write_tiny(tmp_path / model_type, model_type, vocab_size=V, max_position_embeddings=BLOCK, **shape)
    config = hf.load_config(directory)
    template = hf.build_template(config)
    params = _spread(hf.init_params(template, rng.key(5)))
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = theirs.load_state_dict(params, strict=False)
    assert not unexpected and not set(missing) & {n for n, _ in theirs.named_parameters()} - set(params)
    return template, params, theirs


@pytest.mark.numeric
@pytest.mark.parametrize("model_type", list(HF_TYPES))
def test_hf_family_greedy_equals_transformers_generate_token_for_token(tmp_path, model_type):
    """The hf family through transformers' own attention over a slot cache: 8 prompts of different lengths, 64
    new tokens, the same tokens as transformers' greedy `generate` (dynamic cache), every log-prob a full
    forward's log-softmax; sampled, the same tokens as the recompute path (the cache off)."""
    from functrain.models import hf

    template, params, theirs = _hf(tmp_path, model_type)
    cached = hf.cached_model(template)
    ids, mask = _left_padded(PROMPTS)
    with torch.no_grad():
        want = theirs.generate(
            ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0
        )[:, ids.shape[1] :]
    out = Generator(cached, batch_size=8, compile=False)(params, PROMPTS, 64)
    assert [c.tokens for [c] in out] == want.tolist()
    logits_fn = hf.eval_logits(template)
    for p, [c] in zip(PROMPTS, out):
        full = logits_fn(params, torch.tensor([p + c.tokens]))[0].log_softmax(-1)[len(p) - 1 : -1]  # (64, V)
        assert_close(torch.tensor(c.logprobs), full.gather(-1, torch.tensor(c.tokens)[:, None])[:, 0], rtol(32 * BLOCK))
    same_length = [p[:5] for p in PROMPTS[2:6]]
    sampled = Generator(cached, batch_size=4, compile=False)(
        params, same_length, 16, key=rng.key(3), sampling=Sampling(temperature=0.9, top_k=40)
    )
    recomputed = inference.generate(
        template,
        params,
        torch.tensor(same_length),
        16,
        temperature=0.9,
        top_k=40,
        key=rng.key(3),
        logits_fn=logits_fn,
        block_size=BLOCK,
    )
    assert [c.tokens for [c] in sampled] == recomputed[:, 5:].tolist()


def test_stage_at_a_time_forwards_decode_as_the_whole_forward(tmp_path):
    """The forwards sharded params decode through (`sharded_forward`: a stage at a time over the same cache), run
    on plain params in place of the whole-model forward: gpt's and the hf family's (transformers' layers, each
    its own view) give the whole forward's tokens, greedy and sampled."""
    from functrain.models import hf

    template, _, params = _gpt()
    gpt_cached = inference.cached_model(template, gpt.stages(template), "wte.weight")
    hf_template, hf_params, _ = _hf(tmp_path, "qwen2")
    hf_cached = hf.cached_model(hf_template, stages=hf.stages(hf_template), head=hf.head_name(hf_template))
    for cached, p in ((gpt_cached, params), (hf_cached, hf_params)):
        assert cached.sharded_forward is not None
        staged = cached._replace(forward=cached.sharded_forward)
        for kw in ({}, dict(key=rng.key(4), sampling=Sampling(temperature=0.9))):
            want = Generator(cached, batch_size=4, compile=False)(p, PROMPTS[:4], 24, **kw)
            got = Generator(staged, batch_size=4, compile=False)(p, PROMPTS[:4], 24, **kw)
            assert [c.tokens for [c] in got] == [c.tokens for [c] in want]


@pytest.mark.parametrize("whole", [True, False])
def test_hf_cache_probe_refuses_a_cache_that_differs(tmp_path, monkeypatch, capsys, whole):
    """The probe at build time (on the whole model, or on its first two layers as for a large one): a slot cache
    whose query offset is wrong (the masks see slot 0 for every new token) differs from the plain forward, and
    `cached_model` refuses it in one line; a run's `run_cache` then says so in one note line and recomputes."""
    from functrain.models import hf
    from functrain.models.hf import cache, probe

    template, _, _ = _hf(tmp_path, "llama")
    right = cache._slot_layer()

    class Wrong(right):
        def get_seq_length(self):
            return 0

    if not whole:
        monkeypatch.setattr(probe, "PROBE_NUMEL", 0)
        assert hf.probe_subject(template)[2] == [0, 1]
    assert hf.cached_model(template).cache_shape == (2, 2, 8)
    monkeypatch.setattr(cache, "_slot_layer", lambda: Wrong)
    with pytest.raises(hf.HFModelError, match=r"llama: its forward through a KV cache differs from its plain") as e:
        hf.cached_model(template)
    assert "\n" not in str(e.value)
    run = types.SimpleNamespace(tp_world=1, is_main_process=True)  # a run on one process
    assert hf.run_cache(run, template, template, None, None) is None  # the run recomputes, and says so:
    assert re.fullmatch(
        r"functrain: note: llama: its forward through a KV cache differs.*without a KV cache\n", capsys.readouterr().err
    )


@pytest.mark.slow
def test_hf_family_compiles_one_prefill_graph_per_bucket_one_decode_graph(tmp_path):
    """Compiled, the hf family's slot cache: equal to eager, a prefill per bucket and one decode graph, no
    recompiles over batches of other prompt lengths (its masks rebuilt from tensors, not Python ints)."""
    from torch._dynamo.utils import counters

    from functrain.models import hf

    template, params, _ = _hf(tmp_path, "gemma2")
    cached = hf.cached_model(template)
    eager = Generator(cached, batch_size=4, compile=False)
    gen = Generator(cached, batch_size=4, compile=True)
    torch._dynamo.reset()
    counters.clear()
    for prompts in (PROMPTS[:4], PROMPTS[5:8], [p[:2] for p in PROMPTS[2:6]]):  # buckets 16, 32, 16
        got = gen(params, prompts, 24, key=rng.key(5), sampling=Sampling(temperature=0.8))
        want = eager(params, prompts, 24, key=rng.key(5), sampling=Sampling(temperature=0.8))
        assert [c.tokens for [c] in got] == [c.tokens for [c] in want]
    assert counters["stats"]["unique_graphs"] == 3  # prefill_16, prefill_32, decode
    assert sum(counters["recompiles"].values()) == 0


def test_cached_logits_equal_the_recompute_path_and_sampling_does_not_depend_on_the_batch():
    """Sampled (temperature, top-k, top-p, min-p), 2 samples per prompt: the same tokens in batches of 1, 3 and
    8 rows (other padding, other companions); sampled and greedy, the same tokens as `inference.generate`, which
    recomputes every token (the cache off)."""
    template, _, params = _llama()
    sampling = Sampling(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01)
    runs = [
        Generator.of(template, batch_size=b, compile=False)(
            params, PROMPTS[:5], 24, key=rng.key(3), sampling=sampling, n=2
        )
        for b in (1, 3, 8)
    ]
    tokens = [[[c.tokens for c in samples] for samples in run] for run in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert any(a != b for a, b in tokens[0])  # the two samples of a prompt differ: each has its own key
    other = Generator.of(template, batch_size=8, compile=False)(
        params, PROMPTS[:5], 24, key=rng.key(4), sampling=sampling
    )
    assert [[c.tokens] for [c] in other] != [s[:1] for s in tokens[0]]  # another key, other text
    same_length = [p[:5] for p in PROMPTS[2:]]
    cached = Generator.of(template, batch_size=8, compile=False)(
        params, same_length, 24, key=rng.key(3), sampling=Sampling(temperature=0.9, top_k=40)
    )
    recomputed = inference.generate(
        template, params, torch.tensor(same_length), 24, temperature=0.9, top_k=40, key=rng.key(3)
    )  # row b draws as prompt b's first sample: the same text with the cache off
    assert [c.tokens for [c] in cached] == recomputed[:, 5:].tolist()
    greedy = Generator.of(template, batch_size=8, compile=False)(params, PROMPTS, 24)
    for p, [c] in zip(PROMPTS, greedy):
        ref = inference.generate(template, params, torch.tensor([p]), 24, temperature=0, key=rng.key(0))
        assert c.tokens == ref[0, len(p) :].tolist()


def test_stops_at_any_eos_id_and_at_the_stop_rule():
    template, _, params = _gpt()
    gen = Generator.of(template, batch_size=4, compile=False)
    [[free]] = gen(params, PROMPTS[:1], 16)
    eos = free.tokens[5]
    first = free.tokens.index(eos)
    [[stopped]] = gen(params, PROMPTS[:1], 16, eos_ids=[V - 1, eos])
    assert stopped.tokens == free.tokens[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.logprobs == free.logprobs[: first + 1]
    [[ruled]] = gen(params, PROMPTS[:1], 16, stop=lambda i, new: len(new) == 3)
    assert ruled.tokens == free.tokens[:3] and ruled.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.tokens) == 16


@pytest.mark.parametrize("k", [1, 3])
def test_eager_decoding_runs_no_forward_past_the_last_token(k):
    """Eagerly (as sharded params decode) the forward of a call's last token waits until the run goes on, and the
    last call runs only the steps left: the prompt's forward, then one per new token but the last, whether the run
    ends at `max_new_tokens` or at an EOS id (the compiled route, which runs every forward, gives the same tokens:
    `test_one_prefill_graph_per_bucket_one_decode_graph_no_recompiles`)."""
    template, _, params = _gpt()
    cached = generation.CachedModel.of(template)
    calls = []

    def counted(*args):
        calls.append(1)
        return cached.forward(*args)

    gen = Generator(cached._replace(forward=counted), batch_size=1, compile=False, tokens_per_call=k)
    [[free]] = gen(params, PROMPTS[:1], 16)
    assert len(calls) == 1 + 15
    calls.clear()
    [[stopped]] = gen(params, PROMPTS[:1], 16, eos_ids=[free.tokens[6]])
    first = free.tokens.index(free.tokens[6])  # (k=3: a call runs its steps past a stop inside it)
    assert stopped.tokens == free.tokens[: first + 1] and len(calls) == 1 + first + (k - 1 - first % k)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(0.9, top_k=40, top_p=0.95, min_p=0.01)])
def test_several_tokens_per_call_give_the_same_completions(sampling):
    """Decode steps per call (3: it divides neither the 20 new tokens nor where rows stop) change nothing: the same
    tokens, log-probabilities and finish reasons as one step per call, rows stopping inside a call (an EOS id, the
    stop rule) and a cache of exactly the longest request's slots, whose last slot the steps past it overwrite."""
    template, _, params = _gpt()
    prompts, new = PROMPTS[:5], 20
    block = max(len(p) for p in prompts) + new - 1
    one, three = (
        Generator.of(template, block_size=block, batch_size=4, compile=False, tokens_per_call=k) for k in (1, 3)
    )
    [[free]] = one(params, prompts[:1], new, key=rng.key(7), sampling=sampling)
    eos = [free.tokens[4]]  # the first prompt stops at its 5th token (or earlier): inside the second call of 3

    def stop(i, tokens):
        return i == 2 and len(tokens) == 7

    runs = [
        gen(params, prompts, new, key=rng.key(7), sampling=sampling, n=2, eos_ids=eos, stop=stop)
        for gen in (one, three)
    ]
    assert [[(c.tokens, c.logprobs, c.finish_reason) for c in r] for r in runs[0]] == [
        [(c.tokens, c.logprobs, c.finish_reason) for c in r] for r in runs[1]
    ]
    reasons = [c.finish_reason for r in runs[0] for c in r]
    assert "stop" in reasons and "length" in reasons
    assert runs[0][0][0].tokens[-1] == eos[0] and len(runs[0][2][0].tokens) == 7


def test_sampling_warps_as_transformers_warpers():
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 3
    for s in (
        Sampling(0.7, 10, 1.0, 0.0),
        Sampling(1.3, 0, 0.8, 0.0),
        Sampling(1.0, 0, 1.0, 0.1),
        Sampling(0.5, 20, 0.9, 0.05),
    ):
        warpers = transformers.LogitsProcessorList()
        warpers.append(transformers.TemperatureLogitsWarper(s.temperature))
        if s.top_k:
            warpers.append(transformers.TopKLogitsWarper(s.top_k))
        if s.top_p < 1:
            warpers.append(transformers.TopPLogitsWarper(s.top_p))
        if s.min_p:
            warpers.append(transformers.MinPLogitsWarper(s.min_p))
        want = warpers(torch.zeros(4, 1, dtype=torch.long), logits.clone())
        got = s.warp(logits)
        assert torch.equal(got.isinf(), want.isinf()), s
        torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()])


@pytest.mark.slow  # (inductor: the fast tier compiles with aot_eager at most)
def test_one_prefill_graph_per_bucket_one_decode_graph_no_recompiles():
    """Compiled: equal to eager, and three batches of other prompt lengths (two buckets) over 256 tokens each
    compile exactly a prefill per bucket and the decode step once."""
    from torch._dynamo.utils import counters

    template, _, params = _gpt(block=320)
    eager = Generator.of(template, batch_size=4, compile=False)
    gen = Generator.of(template, batch_size=4, compile=True)
    torch._dynamo.reset()
    counters.clear()
    batches = [PROMPTS[:4], PROMPTS[5:8], [p[:2] for p in PROMPTS[2:6]]]  # longest 9, 17, 2: buckets 16, 32, 16
    for prompts, temperature in zip(batches, (0.8, 0.6, 1.1)):  # (another temperature: a value, the same graph)
        got = gen(params, prompts, 256, key=rng.key(5), sampling=Sampling(temperature=temperature))
        want = eager(params, prompts, 256, key=rng.key(5), sampling=Sampling(temperature=temperature))
        assert [c.tokens for [c] in got] == [c.tokens for [c] in want]
        assert all(len(c.tokens) == 256 for [c] in got)
    assert gen.tokens_per_call == 4 and eager.tokens_per_call == 1
    assert counters["stats"]["unique_graphs"] == 3  # prefill_16, prefill_32, decode (4 steps a call)
    assert sum(counters["recompiles"].values()) == 0


def test_bad_requests_are_one_line():
    template, _, params = _gpt()
    gen = Generator.of(template, batch_size=2, compile=False)
    cases = [
        (dict(prompts=[[]]), "prompt 0 is empty; start it with a token"),
        (dict(max_new_tokens=0), "max_new_tokens=0: ask for at least 1"),
        (dict(n=0), "n=0: ask for at least 1 sample"),
        (
            dict(prompts=[[1] * 90]),
            "prompt 0 has 90 tokens: with max_new_tokens=8 it exceeds the cache's block_size 96",
        ),
    ]
    for change, words in cases:
        request = {"prompts": [[1, 2]], "max_new_tokens": 8, "n": 1, **change}
        with pytest.raises(GenerationError, match=words) as err:
            gen(params, request["prompts"], request["max_new_tokens"], n=request["n"])
        assert "\n" not in str(err.value)
    with pytest.raises(GenerationError, match="block_size=200 exceeds the model's 96; give at most 96"):
        Generator.of(template, block_size=200)
    with pytest.raises(GenerationError, match="tokens_per_call=0: give at least 1 decode step per call"):
        Generator.of(template, tokens_per_call=0)
    for bad, words in (
        (dict(top_p=0.0), r"top_p=0.0 is out of range; give a value in \(0, 1\]"),
        (dict(top_p=1.5), "top_p=1.5 is out of range"),
        (dict(temperature=-1.0), "temperature=-1.0 is out of range; give a value >= 0"),
        (dict(top_k=-2), "top_k=-2 is out of range"),
        (dict(min_p=2.0), "min_p=2.0 is out of range"),
    ):
        with pytest.raises(GenerationError, match=words):
            Sampling(**bad)
