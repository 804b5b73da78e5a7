"""functrain.eval against lm-evaluation-harness's HFLM on the same tiny models (a transformers model read by
the hf family, and functrain's GPT through its Hugging Face export), with a BPE tokenizer of functrain's own:
`loglikelihood` and `loglikelihood_rolling` equal within 1e-4 (float32), a local multiple-choice task run
through `lm_eval.simple_evaluate` gives the same acc and acc_norm with either model, and greedy
`generate_until` gives the same text."""

from __future__ import annotations

import json
import re

import pytest
import torch

from functrain import data as data_lib
from functrain import eval as fe
from functrain import rng
from functrain.interop.hf import save_hf_directory
from functrain.models import inference
from functrain.models.gpt import model as gpt_lib
from functrain.models.gpt.hf import export_hf_gpt2, hf_gpt2_config

pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

from functrain.eval.harness import FunctrainLM  # noqa: E402  (it imports lm_eval)

BLOCK = 32
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    x: int = 0\n    y: int = 0\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "import os\nprint(os.getcwd())\n",
] * 20
PAIRS = [
    ("def add(a, b):", "\n    return a + b"),
    ("def add(a, b):\n    return ", "a + b"),  # trailing spaces in the context: moved to the continuation
    ("class Point:\n   ", " x: int = 0"),
    ("", "import os"),  # empty context: the prefix token
    ("for i in range(10):\n" * 6, "    print(i)"),  # longer than the block: the context's head is cut
    ("x", " = 1\n"),
]
ROLLING = ["import os\nprint(os.getcwd())\n", "def add(a, b):\n    return a + b\n" * 4]  # one and several windows


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE of functrain's own (`train_bpe`), 300 ids."""
    return data_lib.train_bpe(TEXTS, 300, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _hflm(directory, tokenizer):
    """lm-eval's HFLM on the exported directory, float32 on the CPU, the same block and tokenizer. Its logits
    cache is off: lm-eval 0.4.13 scores two requests of one token sequence (PAIRS' first two: the same text cut
    at another place) with the first one's continuation length (-18.09 for the second, -17.33 recomputed)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer.path), eos_token=data_lib.END_OF_TEXT, pad_token=data_lib.END_OF_TEXT
    )
    return HFLM(
        pretrained=str(directory),
        tokenizer=tok,
        max_length=BLOCK,
        batch_size=4,
        device="cpu",
        dtype="float32",
        logits_cache=False,
    )


def _sharpen(params: dict, scale: float) -> dict:
    """Params scaled up, so that the tiny model's distributions are far from uniform."""
    return {k: v * scale if v.ndim > 1 else v for k, v in params.items()}


@pytest.fixture(scope="module")
def gpt_pair(tokenizer, tmp_path_factory):
    """(functrain's GPT as an EvalModel, its params, HFLM on its Hugging Face export)."""
    cfg = gpt_lib.GPTConfig(
        vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True
    )
    with torch.device("meta"):
        template = gpt_lib.GPT(cfg)
    params = _sharpen(gpt_lib.init_params(template, rng.key(0)), 6.0)
    out = save_hf_directory(
        tmp_path_factory.mktemp("gpt"), export_hf_gpt2(params, cfg), hf_gpt2_config(cfg), tokenizer_file=tokenizer.path
    )
    model = inference.eval_model(
        template, tokenizer, block_size=BLOCK, stages=gpt_lib.stages(template), head="wte.weight"
    )
    return model, params, _hflm(out, tokenizer)


@pytest.fixture(scope="module")
def hf_pair(tokenizer, tmp_path_factory):
    """(a transformers Qwen2 as the hf family reads it, its params, HFLM on the same directory)."""
    from functrain.models import hf
    from functrain.models.hf.tiny import write_tiny

    directory = write_tiny(
        tmp_path_factory.mktemp("qwen2"),
        "qwen2",
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    template = hf.build_template(hf.load_config(directory))
    params = _sharpen(hf.init_params(template, rng.key(1)), 4.0)
    config = json.loads((directory / "config.json").read_text())
    save_hf_directory(directory, params, config, tokenizer_file=tokenizer.path)
    model = inference.eval_model(
        template,
        tokenizer,
        block_size=BLOCK,
        stages=None,
        head=None,
        logits_fn=hf.eval_logits(template),
        cached=hf.cached_model(template),
    )
    return model, params, _hflm(directory, tokenizer)


def _instances(kind: str, args: list) -> list:
    """lm-eval `Instance`s of one request type."""
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.mark.numeric
@pytest.mark.parametrize("pair", ["gpt_pair", "hf_pair"])
def test_loglikelihood_and_rolling_equal_hflm(pair, request):
    model, params, hflm = request.getfixturevalue(pair)
    assert model.prefix_id == hflm.prefix_token_id  # the empty context's token is the same
    ours = fe.loglikelihood(model, params, PAIRS, scorer=fe.Scorer(model, batch_size=4))
    theirs = hflm.loglikelihood(_instances("loglikelihood", PAIRS))
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert torch.allclose(
        torch.tensor([lp for lp, _ in ours]), torch.tensor([lp for lp, _ in theirs]), atol=1e-4, rtol=0
    )
    assert len({round(lp, 3) for lp, _ in ours}) == len(PAIRS)  # distinct numbers: the comparison can fail
    rolled = fe.loglikelihood_rolling(model, params, ROLLING)
    theirs_rolled = hflm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in ROLLING]))
    assert torch.allclose(
        torch.tensor(rolled, dtype=torch.float64), torch.tensor(theirs_rolled, dtype=torch.float64), atol=1e-4, rtol=0
    )


@pytest.mark.numeric
@pytest.mark.parametrize("pair", ["gpt_pair", "hf_pair"])
def test_generate_until_greedy_equals_hflm(pair, request):
    """Through each family's KV cache (gpt's own attention; transformers' Qwen2 over a slot cache)."""
    model, params, hflm = request.getfixturevalue(pair)
    assert model.cached is not None
    requests = [
        ("def add(a, b):\n", {"until": ["\n"], "max_gen_toks": 8}),
        ("class", {"until": [":"], "max_gen_toks": 6}),
    ]
    ours = fe.generate_until(model, params, requests)
    theirs = hflm.generate_until(_instances("generate_until", requests))
    assert ours == theirs


def _local_task(tmp_path) -> str:
    """A 6-question multiple-choice task (a jsonl file and its yaml) lm-eval reads from a directory."""
    rows = [
        {"q": TEXTS[i % 4].split("\n")[0], "choices": [" a + b", " return", " x: int", " print(i)"], "gold": i % 4}
        for i in range(6)
    ]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "local_mc.yaml").write_text(
        "task: local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        + str(tmp_path / "mc.jsonl")
        + "\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return str(tmp_path)


@pytest.mark.numeric
def test_simple_evaluate_local_task_same_as_hflm(gpt_pair, tmp_path):
    from lm_eval.tasks import TaskManager

    model, params, hflm = gpt_pair
    manager = TaskManager(include_path=_local_task(tmp_path))
    runs = [
        lm_eval.simple_evaluate(model=m, tasks=["local_mc"], task_manager=manager)["results"]["local_mc"]
        for m in (FunctrainLM(model, params, batch_size=4), hflm)
    ]
    assert runs[0]["acc,none"] == runs[1]["acc,none"]
    assert runs[0]["acc_norm,none"] == runs[1]["acc_norm,none"]


def test_from_checkpoint_reads_the_params_of_a_saved_state(gpt_pair, tmp_path):
    from functrain import checkpoint as ckpt

    model, params, _ = gpt_pair
    ckpt.save(str(tmp_path / "7"), {"params": params, "step": torch.tensor(7)})
    fresh = {k: torch.zeros_like(v) for k, v in params.items()}
    restored = FunctrainLM.from_checkpoint(model, tmp_path / "7", fresh, batch_size=4)
    assert all(torch.equal(restored.params[k], params[k]) for k in params)
    requests = _instances("loglikelihood", PAIRS[:3])
    assert restored.loglikelihood(requests) == FunctrainLM(model, params, batch_size=4).loglikelihood(requests)


@pytest.mark.numeric
def test_max_length_defaults_as_hflms(hf_pair, tokenizer):
    """Neither side given a length: both read the model's positions (the Qwen2's max_position_embeddings=64, twice
    the trained block), so a long text's rolling log-likelihood is scored in the same windows."""
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    model, params, hflm = hf_pair
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer.path), eos_token=data_lib.END_OF_TEXT, pad_token=data_lib.END_OF_TEXT
    )
    theirs = HFLM(pretrained=hflm.model, tokenizer=tok, batch_size=4, device="cpu", logits_cache=False)
    ours = FunctrainLM(model, params, batch_size=4)
    assert ours.max_length == theirs.max_length == 64 != model.block_size
    texts = ["\n".join(TEXTS[:12])]  # well over 64 tokens: several windows
    assert len(tokenizer.encode(texts[0])) > 2 * 64
    rolled = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]))
    reference = theirs.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]))
    assert rolled[0] == pytest.approx(reference[0], abs=1e-3)
    at_block = FunctrainLM(model, params, batch_size=4, max_length=model.block_size)
    cut = at_block.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]))
    assert abs(cut[0] - reference[0]) > 1.0  # the windows matter: the test can fail


def test_sampling_options_are_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from functrain.generation import Sampling

    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, k, p in [(0.7, 0, 0.9), (1.0, 5, 1.0), (1.3, 10, 0.5), (1.0, 0, 0.01)]:
        ref = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        ours = Sampling(temperature, k, p).warp(logits[None])[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(ref[0]))
        assert torch.allclose(ours[~torch.isinf(ours)], ref[0][~torch.isinf(ours)])


def test_generate_until_takes_the_harness_sampling_options(gpt_pair):
    model, params, _ = gpt_pair
    greedy = fe.generate_until(model, params, [("def add(a, b):\n", {"until": ["\n"], "max_gen_toks": 8})])
    key = rng.key(3)
    for options in ({"top_k": 1}, {"top_p": 1e-6}):
        sampled = {"until": ["\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 1.5, **options}
        assert fe.generate_until(model, params, [("def add(a, b):\n", sampled)], key=key) == greedy
    wide = {"until": ["\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 1.5, "top_p": 0.95, "top_k": 50}
    draws = {fe.generate_until(model, params, [("def add(a, b):\n", wide)], key=rng.key(s))[0] for s in range(6)}
    assert len(draws) > 1
    for bad, says in (
        ({"num_beams": 4}, "options ['num_beams'] are not supported"),
        ({"top_p": 0.0}, "top_p=0.0 is out of range; give a value in (0, 1]"),
        ({"temperature": -1.0}, "temperature=-1.0 is out of range"),
        ({"top_k": -2}, "top_k=-2 is out of range"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)) as err:
            fe.generate_until(model, params, [("x", bad)], key=key)
        assert "\n" not in str(err.value)


def _gen_task(tmp_path, generation_kwargs: str) -> str:
    """A local generate_until task of 4 questions (a jsonl file and its yaml) with these generation kwargs."""
    rows = [{"q": t.split("\n")[0], "a": "x"} for t in TEXTS[:4]]
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "local_gen.yaml").write_text(
        "task: local_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        + str(tmp_path / "gen.jsonl")
        + "\ntest_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        + f"generation_kwargs:\n{generation_kwargs}metric_list:\n  - metric: exact_match\n"
    )
    return str(tmp_path)


def test_simple_evaluate_runs_a_sampling_generate_until_task(gpt_pair, tmp_path):
    """A generate_until task whose gen_kwargs sample (do_sample, temperature, top_p, top_k, as harness tasks set
    them) runs through simple_evaluate on the default key, the same twice."""
    from lm_eval.tasks import TaskManager

    model, params, _ = gpt_pair
    kwargs = "  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: true\n  temperature: 0.8\n  top_p: 0.9\n  top_k: 20\n"
    manager = TaskManager(include_path=_gen_task(tmp_path, kwargs))
    runs = [
        lm_eval.simple_evaluate(
            model=FunctrainLM(model, params, batch_size=4), tasks=["local_gen"], task_manager=manager, log_samples=True
        )
        for _ in range(2)
    ]
    outputs = [[s["resps"] for s in r["samples"]["local_gen"]] for r in runs]
    assert outputs[0] == outputs[1] and "exact_match,none" in runs[0]["results"]["local_gen"]


@pytest.mark.numeric
@pytest.mark.parametrize("pair", ["gpt_pair", "hf_pair"])
def test_simple_evaluate_greedy_generate_until_task_same_as_hflm(pair, request, tmp_path):
    """A greedy generate_until task with stop strings through simple_evaluate: FunctrainLM (its KV cache) gives
    HFLM's responses, each cut at the first stop string."""
    from lm_eval.tasks import TaskManager

    model, params, hflm = request.getfixturevalue(pair)
    manager = TaskManager(
        include_path=_gen_task(tmp_path, "  until: [':', '(']\n  max_gen_toks: 10\n  do_sample: false\n")
    )
    runs = [
        lm_eval.simple_evaluate(model=lm, tasks=["local_gen"], task_manager=manager, log_samples=True)
        for lm in (FunctrainLM(model, params, batch_size=4), hflm)
    ]
    ours, theirs = ([s["resps"] for s in r["samples"]["local_gen"]] for r in runs)
    assert ours == theirs and len(ours) == 4
