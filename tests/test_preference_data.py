"""Preference pairs rendered and batched as TRL's DPOTrainer does (its own `_prepare_dataset` and
`DataCollatorForPreference`), on tokenizers as Qwen2.5, Llama-3 and DeepSeek ship them: text pairs, conversations
with a prompt, and conversations whose prompt is their common turns; truncation keeping the start or the end."""

from __future__ import annotations

import json
import tempfile
import types

import _tokenizer_dirs as dirs
import numpy as np
import pytest
import torch
import transformers
from datasets import Dataset
from trl.trainer import dpo_trainer as trl_dpo

from functrain.data import pairs as pairs_lib
from functrain.data import supervised as S
from functrain.data.errors import DataError
from functrain.data.tokenizer import HFTokenizer


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


TEXT = [
    {"prompt": "def add(a, b):", "chosen": "\n    return a + b\n", "rejected": "\n    return a - b\n"},
    {"prompt": "The quick brown fox", "chosen": " jumps over the lazy dog.", "rejected": " sleeps."},
    {"prompt": "What does json.dumps do?", "chosen": " It serializes an object.", "rejected": " Nothing"},
]
CHATS = [
    {"prompt": [_user("2+2=?")], "chosen": [_assistant("4")], "rejected": [_assistant("5, or 17+25=42")]},
    {
        "prompt": [{"role": "system", "content": "You are a helpful assistant."}, _user("hello there")],
        "chosen": [_assistant("hello, how are you today?")],
        "rejected": [_assistant("what?")],
    },
]
IMPLICIT = [  # no prompt field: the prompt is the common start (TRL's extract_prompt)
    {"chosen": [_user("2+2=?"), _assistant("4")], "rejected": [_user("2+2=?"), _assistant("five")]},
]
IMPLICIT_TEXT = [{"chosen": "The sky is blue.", "rejected": "The sky is green."}]


@pytest.fixture(scope="module")
def made():
    """{style: tokenizer directory}, written once for the module."""
    root = tempfile.mkdtemp()
    return {s: dirs.write(f"{root}/{s}", s) for s in dirs.STYLES}


def _trl(directory, records, max_length, truncation):
    """TRL's rows of `records`: its dataset preparation (prompt extraction, EOS, tokenization, the drop of
    fully truncated pairs) on a trainer holding only what it reads, then its collator."""
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    trainer = object.__new__(trl_dpo.DPOTrainer)
    trainer._tokenizer = tok
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode=truncation)
    dataset = trl_dpo.DPOTrainer._prepare_dataset(trainer, Dataset.from_list(records), tok, args, "train")
    rows = list(dataset)
    collate = trl_dpo.DataCollatorForPreference(pad_token_id=0, max_length=max_length, truncation_mode=truncation)
    return rows, (collate(rows) if rows else None)


def _check_as_trls(x, y, batch):
    """functrain's (B, 2, T) rows, in TRL's layout (chosen rows, then rejected rows), are TRL's inputs, and their
    targets TRL's next tokens where its completion mask is set."""
    rows = lambda t: torch.cat([t[:, 0], t[:, 1]])  # (B, 2, T) -> (2B, T)  # noqa: E731
    x, y, t = rows(x), rows(y), batch["input_ids"].shape[1] - 1
    learned = batch["completion_mask"][:, 1:].bool()
    inputs = batch["attention_mask"][:, 1:].bool()  # the positions that predict a token (a row's last does not)
    assert x.shape[-1] == t and torch.equal(x[inputs], batch["input_ids"][:, :t][inputs])
    assert (x[~inputs] == 0).all()  # padding
    assert torch.equal(y != -1, learned)
    assert torch.equal(y[learned], batch["input_ids"][:, 1:][learned])


@pytest.mark.parametrize("style", dirs.STYLES)
@pytest.mark.parametrize("records", ["text", "chats", "implicit", "implicit text"])
def test_pairs_and_their_rows_equal_trls(made, style, records):
    records = {"text": TEXT, "chats": CHATS, "implicit": IMPLICIT, "implicit text": IMPLICIT_TEXT}[records]
    d = made[style]
    tok = HFTokenizer(d)
    template = S.chat_template_of(d, tok.special.template_vars())
    ours = [pairs_lib.render_pair(r, tok, template=template) for r in records]
    theirs, batch = _trl(d, records, None, "keep_start")
    for p, row in zip(ours, theirs, strict=True):
        assert (p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()) == (
            row["prompt_ids"],
            row["chosen_ids"],
            row["rejected_ids"],
        )
    x, y, dropped = pairs_lib.pair_rows(ours, max_length=10_000)
    assert dropped == 0 and x.shape[:2] == (len(records), 2)
    _check_as_trls(x, y, batch)


@pytest.mark.parametrize("truncation", pairs_lib.TRUNCATION)
def test_long_pairs_are_cut_or_dropped_as_trl_does(made, truncation):
    d = made["qwen2.5"]
    tok = HFTokenizer(d)
    long_prompt = {"prompt": "hello there, " * 12, "chosen": " yes", "rejected": " no"}
    records = [*TEXT, long_prompt]
    ours = [pairs_lib.render_pair(r, tok) for r in records]
    max_length = 12
    assert len(ours[-1].prompt) >= max_length and any(len(p.prompt) + len(p.chosen) > max_length for p in ours[:3])
    theirs, batch = _trl(d, records, max_length, truncation)
    x, y, dropped = pairs_lib.pair_rows(ours, max_length=max_length, truncation=truncation)
    assert dropped == (1 if truncation == "keep_start" else 0) == len(records) - len(theirs)
    _check_as_trls(x, y, batch)
    assert x.shape[-1] <= max_length - 1


def test_rows_keep_each_pair_together_and_score_only_its_completions():
    p = pairs_lib.Pair(np.array([5, 6, 7]), np.array([8, 9]), np.array([10]))
    q = pairs_lib.Pair(np.array([1]), np.array([2, 3, 4]), np.array([11, 12]))
    x, y, _ = pairs_lib.pair_rows([p, q], max_length=100, pad_id=99, length=6)
    assert x.tolist() == [
        [[5, 6, 7, 8, 99, 99], [5, 6, 7, 99, 99, 99]],
        [[1, 2, 3, 99, 99, 99], [1, 11, 99, 99, 99, 99]],
    ]
    assert y.tolist() == [
        [[-1, -1, 8, 9, -1, -1], [-1, -1, 10, -1, -1, -1]],
        [[2, 3, 4, -1, -1, -1], [11, 12, -1, -1, -1, -1]],
    ]
    with pytest.raises(ValueError, match="length=2 is shorter than the batch's longest sequence"):
        pairs_lib.pair_rows([p], max_length=100, length=2)


def test_a_record_without_its_fields_is_one_line(made):
    tok = HFTokenizer(made["qwen2.5"])
    with pytest.raises(DataError, match=r"needs fields 'chosen' and 'rejected' \(missing \['rejected'\]"):
        pairs_lib.render_pair({"prompt": "a", "chosen": "b"}, tok)
    with pytest.raises(DataError, match="rendered by a chat template, and none was given"):
        pairs_lib.render_pair(CHATS[0], tok)
    renamed = {"question": "a", "good": " b", "bad": " c"}
    pair = pairs_lib.render_pair(renamed, tok, fields={"prompt": "question", "chosen": "good", "rejected": "bad"})
    assert pair.chosen[-1] == tok.special.eos_id


def _load(tmp_path, records, tok, *, block_size=256, too_long="drop", val_fraction=0.0):
    """The trainer's pairs of `records` (a jsonl file): `load_examples`' train and val sets and info."""
    from functrain.data.examples import ExampleSpec, load_examples

    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = ExampleSpec("auto", "auto", (), None, block_size, too_long, val_fraction)
    lines: list = []
    train, val, info = load_examples(str(src), tmp_path / "cache", tok, spec, log=lines.append)
    return train, val, info, lines


def test_the_trainer_reads_pairs_as_the_python_pieces_make_them(made, tmp_path):
    tok = HFTokenizer(made["qwen2.5"])
    assert S.detect_format(TEXT[0], {}) == "preference"
    assert S.detect_format({"q": "a", "good": "b", "bad": "c"}, {"chosen": "good", "rejected": "bad"}) == "preference"
    records = TEXT * 4
    train, val, info, _ = _load(tmp_path, records, tok, val_fraction=0.3)
    assert info["fmt"] == "preference" and sum(info["examples"]) == len(records)
    assert len(train) == 2 * info["examples"][0] and len(val) == 2 * info["examples"][1] > 0
    from functrain.data.sft import ExampleSampler

    sampler = ExampleSampler(train, batch_size=2, block_size=256, seed=0, packing=False, pad_id=0, group=2)
    x, y = sampler.tensors(train, [[0], [1]], 64)
    assert x.shape == y.shape == (2, 2, 64)
    for i in range(2):  # every pair of the set is one record's two answers, rows as `pair_rows` makes them
        chosen = train.tokens[train.offsets[2 * i] : train.offsets[2 * i + 1]]
        pair = next(
            p
            for p in (pairs_lib.render_pair(r, tok) for r in records)
            if np.array_equal(np.r_[p.prompt, p.chosen], chosen)
        )
        want_x, want_y, _ = pairs_lib.pair_rows([pair], max_length=257, length=64)
        assert torch.equal(x[i], want_x[0]) and torch.equal(y[i], want_y[0])
    with pytest.raises(ValueError, match="not packed"):
        ExampleSampler(train, batch_size=2, block_size=256, seed=0, packing=True, pad_id=0, group=2)
    empty = sampler.tensors(val, [[0], []], 32)  # the validation's filler row: a pair with no target
    assert (empty[1][1] == -1).all() and (empty[1][0] != -1).any()


def test_long_pairs_are_dropped_or_truncated_and_counted(made, tmp_path):
    tok = HFTokenizer(made["qwen2.5"])
    long = {"prompt": "a b c", "chosen": " i j k l m n o p q r", "rejected": " s"}
    kept, val, info, lines = _load(tmp_path / "drop", [long, TEXT[1], TEXT[1]], tok, block_size=12)
    assert info["dropped"] == 1 and len(kept) + len(val) == 4 and any("1 pairs longer than" in line for line in lines)
    cut, val, info, _ = _load(tmp_path / "cut", [long, TEXT[1], TEXT[1]], tok, block_size=12, too_long="truncate")
    assert info["truncated"] == 1 and len(cut) + len(val) == 6 and max(max(cut.lengths), max(val.lengths)) == 12


@pytest.mark.parametrize(
    "records, match",
    [
        ([{"prompt": "p", "chosen": " a"}], "is half a preference pair: it needs both 'chosen' and 'rejected'"),
        ([TEXT[0], {"prompt": "p", "chosen": " a"}], "pairs.jsonl:1: a preference record needs fields 'chosen'"),
        (
            [{"prompt": "p", "chosen": " a", "rejected": " a"}] * 3,
            "every pair's chosen and rejected answers are the same",
        ),
        ([{"prompt": "p", "chosen": "", "rejected": " b"}], "the chosen completion is empty"),
        (
            [{"chosen": [_user("hi"), _assistant("a")], "rejected": [_user("yo"), _assistant("b")]}],
            "share no first turn",
        ),
    ],
    ids=["missing rejected", "missing rejected later", "all the same", "empty completion", "no shared prefix"],
)
def test_bad_pairs_are_one_line(made, tmp_path, records, match):
    tok = HFTokenizer(made["qwen2.5"])
    with pytest.raises(DataError, match=match) as err:
        _load(tmp_path, records, tok)
    assert "\n" not in str(err.value)


@pytest.mark.slow  # (a compile of the tiny model per row length)
def test_pair_batches_compile_one_graph_per_row_length(tmp_path):
    """The compile contract of preference batches: each row length compiles once, then 20 steps of varying
    lengths recompile nothing; the compiled step equals the eager one."""
    from torch._dynamo.utils import counters

    from functrain import functional, init_state, make_train_step, optim, preference, rng
    from functrain.data import Batching, ByteTokenizer, Placement, sft_data
    from functrain.models import hf
    from functrain.trainer.defaults import data_config

    g = np.random.default_rng(0)
    words = "the of and to in is was for on that with as by at from".split()
    text = lambda n: " " + " ".join(g.choice(words, int(n)))  # noqa: E731
    records = [
        {"prompt": text(g.integers(1, 8)), "chosen": text(g.integers(1, 20)), "rejected": text(2)} for _ in range(80)
    ]
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = sft_data(
        data_config(path=str(src), val_fraction=0.05),
        Placement(str(tmp_path / "data"), log=lambda line: None),
        Batching(4, 128, seed=0, eval_batches=1),
        tokenizer=ByteTokenizer(),
        template=None,
    )
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    template = hf.build_template(config)
    params = hf.init_params(template, rng.key(0))
    logits = lambda p, x, key: functional.apply(template, p, input_ids=x, train=False).logits  # noqa: E731
    loss_fn = preference.make_loss_fn(logits, preference.Preference("sigmoid", 0.1), reference=preference.reference_of)
    opt = optim.adamw(1e-3)

    def run(compile):
        """(the step, its state and losses after steps 0..19, the graphs made by the first step)."""
        state = init_state(params, opt, frozen=preference.frozen_reference(params))
        options = {"compile_options": {"backend": "aot_eager"}} if compile else {"compile": False}
        step = make_train_step(loss_fn, opt, count_targets=preference.count_pairs(), **options)
        losses, first = [], 0
        for s in range(20):
            state, m = step(state, data.train_batch(s))
            losses.append(float(m["loss"]))
            first = first or counters["stats"]["unique_graphs"]
        return step, state, losses, first

    counters.clear()
    lengths = {int(data.train_batch(s)[0].shape[-1]) for s in range(20)}
    step, state, compiled, first = run(True)
    assert len(lengths) >= 2 and counters["stats"]["unique_graphs"] == first + len(lengths) - 1, dict(counters["stats"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for s in range(20, 40):
            state, _ = step(state, data.train_batch(s))
    np.testing.assert_allclose(compiled, run(False)[2], rtol=1e-5)
