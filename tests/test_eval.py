"""functrain.eval: the three multiple-choice conventions on a HellaSwag fixture scored by hand, bad files refused
in one line, rolling windows as lm-eval cuts them, the built-in next_lines task, compiled scoring (one graph per
bucket, no recompiles) equal to eager, sampling independent of the batching, and the eval hook on or off leaving
training bit-identical."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from _tol import rtol

from functrain import checkpoint as ckpt
from functrain import data as data_lib
from functrain import eval as fe
from functrain import rng
from functrain import tree as tree_lib
from functrain.eval import choice, next_lines
from functrain.eval.requests import Row, pair_row, rolling_rows
from functrain.models import inference
from functrain.models.gpt import model as gpt_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTES = data_lib.ByteTokenizer()

# -- a model whose numbers a person computes by hand: log p(byte) = w[byte] - log Z whatever the context,
#    w = 2 for "aeiou " and 0 for the 250 other bytes, log Z = log(6 e^2 + 250) = 5.6847. A HellaSwag ending e is
#    scored as " " + e: log p = 2 (vowels + 1) - (len(e) + 1) log Z.
_W = torch.zeros(256)
_W[list(b"aeiou ")] = 2.0
UNIGRAM = fe.EvalModel(lambda p, ms, ids: _W.expand(*ids.shape, 256), BYTES, block_size=64, prefix_id=10)
HELLASWAG = [  # by hand, (log p; per character of the ending; per token = per byte of " " + ending):
    # b -9.369 -9.369 -4.685 | aaaa -18.424 -4.606 -3.685 | b*10 -60.53 -6.053 -5.503 | eb -13.054 -6.527 -4.351
    # acc picks 0 (right), acc_norm 1, acc_mean_token 1
    {
        "ind": 0,
        "activity_label": "Baking cookies",
        "ctx_a": "A woman [title] mixes flour.",
        "ctx_b": "she",
        "endings": ["b", "aaaa", "bbbbbbbbbb", "eb"],
        "label": 0,
    },
    # ab -13.054 -6.527 -4.351 | a -7.369 -7.369 -3.685 | bbbb -26.42 -6.606 -5.285 | bb -15.054 -7.527 -5.018
    # acc picks 1, acc_norm 0 (right), acc_mean_token 1
    {"ind": 1, "ctx": "A man  plays [header] the piano.", "endings": ["ab", "a", "bbbb", "bb"], "label": "0"},
    # x -9.369 -9.369 -4.685 | yy -15.054 -7.527 -5.018 | aeiouaeiou -40.53 -4.053 -3.685 | ba -13.054 -6.527 -4.351
    # acc picks 0, acc_norm 2 (right), acc_mean_token 2 (right)
    {
        "ind": 2,
        "activity_label": "Surfing",
        "ctx_a": "Waves roll in.",
        "ctx_b": "a surfer",
        "endings": ["x", "yy", "aeiouaeiou", "ba"],
        "label": 2,
    },
]


def _jsonl(path, records) -> str:
    """`records` written one JSON object per line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_hellaswag_fixture_scored_three_ways_by_hand(tmp_path):
    examples = choice.load(_jsonl(tmp_path / "hs.jsonl", HELLASWAG))
    # lm-eval's hellaswag preprocessing: label + ": " + ctx_a + " " + ctx_b capitalized, [title] -> ". ", [..] gone
    assert examples[0].context == "Baking cookies: A woman. mixes flour. She"
    assert examples[1].context == "A man plays the piano."
    assert examples[0].delimiter == " " and examples[1].label == 0
    scores = choice.evaluate(UNIGRAM, {}, examples, scorer=fe.Scorer(UNIGRAM, batch_size=5))
    assert scores == {"acc": 1 / 3, "acc_norm": 2 / 3, "acc_mean_token": 1 / 3, "examples": 3}
    log_z = math.log(6 * math.e**2 + 250)
    ((lp, _),) = fe.loglikelihood(UNIGRAM, {}, [(examples[0].context, " aaaa")])
    assert lp == pytest.approx(2 * 5 - 5 * log_z, rel=1e-6)  # the hand formula itself


def test_plain_format_scores_choices_as_written(tmp_path):
    path = _jsonl(
        tmp_path / "plain.jsonl",
        [
            {"context": "Q", "choices": ["b", "a"], "label": 1},
            "",
            {"context": "Q", "choices": [" a", "bb"], "label": 0},
        ],
    )
    examples = choice.load(path)
    assert [e.delimiter for e in examples] == ["", ""] and len(examples) == 2
    assert choice.evaluate(UNIGRAM, {}, examples, scorer=fe.Scorer(UNIGRAM))["acc"] == 1.0
    assert len(choice.load(path, limit=1)) == 1


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"context": "Q", "choices": ["a", "b"], "label": 1', "not valid JSON"),
        ('{"context": "Q", "choices": ["a", "b"], "label": 2}', "out of range for 2 choices"),
        ('{"context": "Q", "choices": ["a", "b"], "label": "x"}', "not an integer"),
        ('{"context": "Q", "label": 0}', "missing or malformed field"),
        ('["Q", "a"]', "not a JSON object"),
    ],
)
def test_a_bad_line_is_one_error_naming_file_line_and_fix(tmp_path, line, says):
    path = _jsonl(tmp_path / "bad.jsonl", [{"context": "Q", "choices": ["a", "b"], "label": 0}, line])
    with pytest.raises(data_lib.DataError) as err:
        choice.load(path)
    message = str(err.value)
    assert message.startswith(f"{path}:2: ") and says in message and "\n" not in message


def test_an_example_longer_than_the_block_is_refused_or_truncated(tmp_path):
    examples = choice.load(_jsonl(tmp_path / "long.jsonl", [{"context": "x" * 100, "choices": ["a", "b"], "label": 0}]))
    with pytest.raises(
        data_lib.DataError, match=r"long.jsonl:1: the example is 100 tokens, longer than the block of 64"
    ):
        choice.rows_of(examples, UNIGRAM)
    rows = choice.rows_of(examples, UNIGRAM, truncate=True)
    assert [len(r.tokens) for r in rows] == [65, 65] and rows[0].tokens[-1] == ord("a")


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 16, 17, 40])
def test_rolling_windows_are_lm_evals(n):
    from lm_eval import utils  # pytest.importorskip would skip the whole module's fast tests

    text = "".join(chr(97 + i % 26) for i in range(n))
    ids = list(text.encode())
    theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(ids, 10, 8, 1)]
    expected = [Row((a + b)[-9:], len(b)) for a, b in theirs]
    assert rolling_rows(BYTES, text, prefix_id=10, block_size=8) == expected
    assert sum(r.scored for r in expected) == n  # every token once


def test_pair_rows_move_trailing_spaces_and_keep_the_last_block():
    assert pair_row(BYTES, "a  ", "b", prefix_id=10, block_size=8) == Row([97, 32, 32, 98], 3)
    assert pair_row(BYTES, "", "ab", prefix_id=10, block_size=8) == Row([10, 97, 98], 2)
    assert pair_row(BYTES, "", "\nab", prefix_id=10, block_size=8) == Row([10, 97, 98], 2)  # starts with the prefix
    assert pair_row(BYTES, "0123456789", "ab", prefix_id=10, block_size=4) == Row([55, 56, 57, 97, 98], 2)


def test_next_lines_is_deterministic_fits_the_block_and_asks_the_true_line():
    docs = [p.read_text() for p in data_lib.stdlib_files()[:40]]
    a = next_lines.build(docs, BYTES, block_size=96, n=50, seed=0)
    assert a == next_lines.build(docs, BYTES, block_size=96, n=50, seed=0)
    assert a != next_lines.build(docs, BYTES, block_size=96, n=50, seed=1)
    for ex in a:
        assert len(ex.choices) == 4 and len({c.strip() for c in ex.choices}) == 4
        true = ex.choices[ex.label]
        assert any((ex.context + true) in d for d in docs)  # the real next line after the real context
        assert max(len(BYTES.encode(ex.context + c)) for c in ex.choices) <= 97
    assert len({ex.label for ex in a}) == 4  # the true line's place is shuffled


def _tiny_gpt_model(block=32):
    """A tiny byte GPT as an EvalModel, with sharpened params."""
    cfg = gpt_lib.GPTConfig(vocab_size=256, block_size=block, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False)
    with torch.device("meta"):
        template = gpt_lib.GPT(cfg)
    params = {k: v * 4 if v.ndim > 1 else v for k, v in gpt_lib.init_params(template, rng.key(3)).items()}
    return inference.eval_model(
        template, BYTES, block_size=block, stages=gpt_lib.stages(template), head="wte.weight"
    ), params


def test_sampled_generation_is_keyed_per_request_whatever_the_batch():
    model, params = _tiny_gpt_model()
    requests = [
        (f"def f{i}(", {"until": [")"], "max_gen_toks": 6, "do_sample": True, "temperature": 1.0}) for i in range(5)
    ]
    key = rng.key(7)
    one = fe.generate_until(model, params, requests, key=key, scorer=fe.Scorer(model, batch_size=1))
    many = fe.generate_until(model, params, requests, key=key, scorer=fe.Scorer(model, batch_size=4))
    assert one == many and len(set(one)) > 1
    assert fe.generate_until(model, params, requests, key=rng.key(8)) != one
    assert model.cached is not None  # the family's model generates through its KV cache; without it, recomputed:
    assert fe.generate_until(model._replace(cached=None), params, requests, key=key) == one  # the same text
    with pytest.raises(ValueError, match="pass key="):
        fe.generate_until(model, params, requests)


@pytest.mark.slow
def test_compiled_scoring_one_graph_per_bucket_no_recompiles_equal_to_eager():
    from torch._dynamo.utils import counters

    model, params = _tiny_gpt_model()
    requests = [("x" * (i % 25), "y" * (1 + i % 5)) for i in range(40)]  # inputs of 1 to 28 tokens: buckets 16, 32
    eager = fe.loglikelihood(model, params, requests, scorer=fe.Scorer(model, batch_size=8, buckets=(16, 32)))
    compiled_scorer = fe.Scorer(model, batch_size=8, buckets=(16, 32), compile=True)
    counters.clear()
    first = fe.loglikelihood(model, params, requests, scorer=compiled_scorer)
    graphs = counters["stats"]["unique_graphs"]
    again = fe.loglikelihood(model, params, [(c + "z", x) for c, x in requests[::-1]], scorer=compiled_scorer)
    fe.loglikelihood(model, params, requests, scorer=compiled_scorer)
    assert graphs == 2 and counters["stats"]["unique_graphs"] == 2  # one per bucket, then none
    assert not counters["recompiles"] and len(again) == len(requests)
    tol = rtol(256 * 32)
    for (a, _), (b, _) in zip(eager, first):
        assert a == pytest.approx(b, rel=tol, abs=tol)
    assert [g for _, g in eager] == [g for _, g in first]


@pytest.mark.slow
@pytest.mark.numeric
def test_two_gloo_ranks_sharded_count_equal_one_process(tmp_path):
    """7 examples (odd: uneven shards) over 2 ranks with FSDP-sharded params: the scores and counts of one process."""
    from _dist_launch import run_ranks

    out = tmp_path / "out"
    run_ranks(os.path.join(REPO, "tests", "_eval_worker.py"), [str(out)], 2, timeout=600)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        del rank["timing"]  # (each rank's own clock)
    assert ranks[0] == ranks[1]
    assert ranks[0]["sharded"] and ranks[0]["examples"] == 7
    for name in ("scores", "rolling"):
        assert torch.allclose(
            torch.tensor(ranks[0][name]), torch.tensor(ranks[0]["single_" + name]), rtol=1e-5, atol=1e-4
        )
    assert ranks[0]["counts"] == ranks[0]["single_counts"]
    assert ranks[0]["generated"] == ranks[0]["single_generated"]
    # sampled: 2 ranks through the cache == 1 process through it == the cache off (2 ranks and 1 process)
    sampled = ranks[0]["sampled"]
    assert sampled == ranks[0]["single_sampled"] == ranks[0]["recomputed"] == ranks[0]["single_recomputed"]
    assert len(set(sampled)) > 1  # draws, not one greedy text
    # without stages: the same draws, the model gathered whole once per call (not once per token, recomputing)
    assert ranks[0]["unstaged_sampled"] == sampled
    assert len(ranks[0]["unstaged_gathers"]) == 1, ranks[0]["unstaged_gathers"]


def _main(workdir, *extra) -> list[dict]:
    """A tiny main-job run's metrics.jsonl rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "functrain.main",
            "--config=configs/gpt.py:tiny",
            "--config.steps=12",
            "--config.log_every=1",
            "--config.eval_every=6",
            "--config.checkpoint.every=6",
            "--config.eval_batches=1",
            "--config.tensorboard=False",
            f"--workdir={workdir}",
            *extra,
        ],
        check=True,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_eval_on_or_off_trains_bit_identically(tmp_path):
    on = _main(
        tmp_path / "on", "--config.eval.tasks=next_lines", "--config.eval.limit=40", "--config.eval.compile=True"
    )
    off = _main(tmp_path / "off", "--config.eval.tasks=")
    losses = [[r["loss"] for r in rows if "loss" in r] for rows in (on, off)]
    assert losses[0] == losses[1] and len(losses[0]) == 12
    assert [r["val_loss"] for r in on if "val_loss" in r] == [r["val_loss"] for r in off if "val_loss" in r]
    mc = [r for r in on if "mc/next_lines/acc" in r]
    assert [r["step"] for r in mc] == [0, 6, 12] and not any("mc/next_lines/acc" in r for r in off)
    for step in (6, 12):  # the whole saved state (params, moments, step, rng), every leaf bit for bit
        saved = [ckpt.restore(str(tmp_path / run / "checkpoints" / str(step))).result() for run in ("on", "off")]
        a, b = (tree_lib.leaves(x) for x in saved)
        assert len(a) == len(b) > 4 and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_users_module_is_scored_in_eval_mode_with_its_model_state():
    """A module with BatchNorm and dropout: `of_module` scores it as `module.eval()` does, with the running
    statistics given as model state (not its own buffers), and leaves that state as it was."""
    from functrain import nn as fnn

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.norm = torch.nn.Embedding(256, 16), torch.nn.BatchNorm1d(16)
            self.drop, self.out = torch.nn.Dropout(0.5), torch.nn.Linear(16, 256)

        def forward(self, ids):  # (B, T) -> (B, T, 256)
            h = self.emb(ids).transpose(1, 2)  # (B, C, T)
            return self.out(self.drop(self.norm(h).transpose(1, 2)))

    torch.manual_seed(0)
    net = Net()
    state = {k: v + 0.5 for k, v in fnn.buffers_of(net).items()}  # running statistics unlike the module's own
    params = dict(net.named_parameters())
    model = fe.of_module(net, BYTES, block_size=16)
    before = {k: v.clone() for k, v in state.items()}
    ours = fe.loglikelihood(model, params, [("abc", "de"), ("x", "yz")], model_state=state)
    with torch.no_grad():
        net.load_state_dict({**params, **state}, strict=False)
        net.eval()
        logits = net(torch.tensor([list(b"abcd")]))[0].log_softmax(-1)  # (T, V)
    expected = float(logits[2, ord("d")] + logits[3, ord("e")])
    assert ours[0][0] == pytest.approx(expected, rel=1e-5)
    assert all(torch.equal(state[k], before[k]) for k in state)


def test_auto_skips_in_one_line_where_an_explicit_task_stops():
    """eval.tasks=auto (the GPT configs' default) goes on without next_lines where the run cannot make it,
    saying why in one line; the same task named explicitly stops the run."""
    from functrain import config_checks
    from functrain.task import Batches, Task
    from functrain.trainer import defaults, downstream

    config = defaults.trainer_config()
    task = Task("t", None, (), None, Batches(None, None), 0, 0.0, None)  # no eval_model, no validation text
    lines = []
    config.eval.tasks = "auto"
    assert downstream.hook(task, config, None, compile=False, whole=True, print_fn=lines.append) is None
    assert len(lines) == 1 and "no next_lines task" in lines[0] and "gives no eval_model" in lines[0]
    config.eval.tasks = "next_lines"
    with pytest.raises(config_checks.ConfigError, match="gives no eval_model"):
        downstream.hook(task, config, None, compile=False, whole=True, print_fn=lines.append)
    model_task = task._replace(eval_model=UNIGRAM, data=Batches(None, None, validation_text=lambda: ["x = 1\n"] * 3))
    with pytest.raises(data_lib.DataError, match="next_lines needs 2 or more"):
        downstream.hook(model_task, config, None, compile=False, whole=True, print_fn=lines.append)
    config.eval.tasks = "auto"
    assert downstream.hook(model_task, config, None, compile=False, whole=False, print_fn=lines.append) is None
    assert "mesh.pp > 1" in lines[-1]


def test_a_context_of_white_space_only_is_the_empty_context():
    assert pair_row(BYTES, "\n  \n", "x", prefix_id=10, block_size=8) == Row([10, 32, 32, 10, 120], 4)
    assert pair_row(BYTES, "  ", "x", prefix_id=10, block_size=8) == Row([10, 32, 32, 120], 3)


def _nanogpt_hellaswag(model, params, tokenizer, records) -> tuple[float, float]:
    """(acc, acc_norm) of nanoGPT's hellaswag.py (karpathy/build-nanogpt), its `render_example` and scoring loop
    as written there: `ctx` and `" " + ending` encoded apart, the ending's cross-entropy summed and averaged."""
    import torch.nn.functional as F

    right = right_norm = 0
    for example in records:
        ctx_tokens = [int(t) for t in tokenizer.encode(example["ctx"])]
        tok_rows, mask_rows = [], []
        for end in example["endings"]:
            end_tokens = [int(t) for t in tokenizer.encode(" " + end)]
            tok_rows.append(ctx_tokens + end_tokens)
            mask_rows.append([0] * len(ctx_tokens) + [1] * len(end_tokens))
        max_len = max(len(row) for row in tok_rows)
        tokens = torch.zeros((len(tok_rows), max_len), dtype=torch.long)
        mask = torch.zeros((len(tok_rows), max_len), dtype=torch.long)
        for i, (tok_row, mask_row) in enumerate(zip(tok_rows, mask_rows)):
            tokens[i, : len(tok_row)] = torch.tensor(tok_row)
            mask[i, : len(mask_row)] = torch.tensor(mask_row)
        logits = model.logits(params, None, tokens)
        shift_logits = logits[..., :-1, :].contiguous()
        shift_tokens = tokens[..., 1:].contiguous()
        shift_losses = F.cross_entropy(
            shift_logits.view(-1, shift_logits.size(-1)), shift_tokens.view(-1), reduction="none"
        ).view(tokens.size(0), -1)
        shift_mask = mask[..., 1:].contiguous()
        sum_loss = (shift_losses * shift_mask).sum(dim=1)
        avg_loss = sum_loss / shift_mask.sum(dim=1)
        right += int(sum_loss.argmin().item() == int(example["label"]))
        right_norm += int(avg_loss.argmin().item() == int(example["label"]))
    return right / len(records), right_norm / len(records)


def _hellaswag_rows(n: int) -> list[dict]:
    """HellaSwag records whose raw and cleaned texts differ ([title], [header], double spaces)."""
    import random

    pick = random.Random(5)
    words = ["the", "man", "a", "woman", "ball", "[title]", "[header]", "then", "runs", "water", "  ", "dog", "red"]

    def text(k):
        return " ".join(pick.choice(words) for _ in range(k)).strip() or "x"

    rows = []
    for i in range(n):
        ctx_a, ctx_b = text(6) + ".", text(2)
        rows.append(
            {
                "ind": i,
                "activity_label": text(2).replace("[title]", "Label"),
                "ctx_a": ctx_a,
                "ctx_b": ctx_b,
                "ctx": ctx_a + " " + ctx_b,
                "endings": [text(pick.randint(2, 6)) for _ in range(4)],
                "label": pick.randint(0, 3),
            }
        )
    return rows


def test_acc_mean_token_is_nanogpts_hellaswag_acc_norm(tmp_path):
    """eval.mean_token=nanogpt (the default) equals nanoGPT's hellaswag.py acc_norm on the same rows and model; the
    harness's rendering (the cleaned query, the pair tokenized together) gives another number on these rows."""
    model, params = _tiny_gpt_model(block=128)
    records = _hellaswag_rows(48)
    examples = choice.load(_jsonl(tmp_path / "hs.jsonl", records))
    ours = choice.evaluate(model, params, examples, scorer=fe.Scorer(model, batch_size=16))
    _, nanogpt_norm = _nanogpt_hellaswag(model, params, BYTES, records)
    assert ours["acc_mean_token"] == nanogpt_norm
    harness = choice.evaluate(model, params, examples, scorer=fe.Scorer(model, batch_size=16), mean_token="harness")
    assert harness["acc_mean_token"] != ours["acc_mean_token"]
    assert (harness["acc"], harness["acc_norm"]) == (ours["acc"], ours["acc_norm"])  # those stay the harness's


@pytest.mark.parametrize(
    "record, says",
    [
        ({"context": "Q", "choices": "bc", "label": 0}, "choices is the string 'bc', not a list"),
        ({"ctx": "Q", "endings": "wxyz", "label": 0}, "endings is the string 'wxyz', not a list"),
        ({"context": "Q", "choices": ["a", "b"], "label": 1.0}, "label 1.0 is a float, not an integer"),
        ({"context": "Q", "choices": ["a", "b"], "label": True}, "label True is a bool, not an integer"),
        ({"context": "Q", "choices": ["a", "b"], "label": "1.0"}, "label '1.0' is not an integer"),
    ],
)
def test_choices_and_labels_of_the_wrong_type_are_one_line(tmp_path, record, says):
    path = _jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(data_lib.DataError) as err:
        choice.load(path)
    assert str(err.value).startswith(f"{path}:1: ") and says in str(err.value) and "\n" not in str(err.value)
    assert choice.load(_jsonl(tmp_path / "ok.jsonl", [{"ctx": "Q", "endings": ["a", "b"], "label": "1"}]))[0].label == 1


def test_a_stop_asked_during_the_scores_ends_them_within_a_batch(tmp_path):
    """The in-loop hook asks `interrupt()` before each batch: once it says stop, no further forward runs and no
    score is written (the loop then stops after its next step with a checkpoint)."""
    from functrain.trainer import downstream

    model, params = _tiny_gpt_model(block=128)
    examples = choice.load(_jsonl(tmp_path / "hs.jsonl", _hellaswag_rows(40)))
    forwards = []
    scorer = fe.Scorer(model, batch_size=8)
    score = scorer._unit
    scorer._unit = lambda *a: (forwards.append(a), score(*a))[1]
    asked = []
    written = []
    writer = type("W", (), {"write": lambda self, step, row: written.append(row)})()
    how = downstream.Scoring(interrupt=lambda: (asked.append(1), len(asked) > 3)[1], print_fn=lambda line: None)
    hook = downstream.MultipleChoice(10, {"hs": examples}, model, scorer, writer, how)
    state = type("S", (), {"params": params, "model_state": None, "frozen": None})()
    assert hook.evaluate(10, state) == {} and written == []
    assert len(forwards) == 3 and len(asked) == 4  # 3 batches ran, the 4th was not started (of 20+)
    how.interrupt = None
    assert set(hook.evaluate(10, state)) == {f"mc/hs/{m}" for m in choice.METRICS} and len(forwards) > 20
