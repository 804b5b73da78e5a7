"""Supervised examples: golden tokens and targets for each format, the chat template rendered as
transformers renders it, masks from spans (EOS learned when pad == eos, the assistant text decoded
back exactly), the one-line refusals, the cache, and epochs of batches that any number of ranks share."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ml_collections import ConfigDict

from functrain.data import Batching, Placement, sft, supervised_format
from functrain.data import supervised as S
from functrain.data.errors import DataError
from functrain.data.examples import ExampleSpec, load_examples
from functrain.data.tokenizer import ByteTokenizer, train_bpe
from functrain.trainer.defaults import data_config

BYTES = ByteTokenizer()
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "done"},
]
# Qwen2's template (transformers' tokenizer_config.json of Qwen2-0.5B-Instruct), one of the common ChatML ones
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _learned(ex) -> str:
    return BYTES.decode(ex.tokens[ex.targets])


def test_prompt_completion_golden():
    ex = S.render({"prompt": "2+2=", "completion": "4"}, "prompt_completion", BYTES, train_on="completion")
    assert ex.tokens.tolist() == list(b"2+2=4\n")  # the byte tokenizer's end of text: its separator
    assert ex.targets.tolist() == [False, False, False, False, True, True]
    ex = S.render({"prompt": "2+2=", "completion": "4"}, "prompt_completion", BYTES, train_on="all")
    assert ex.targets.tolist() == [False] + [True] * 5  # the first token is predicted from nothing


def test_alpaca_and_text_golden():
    ex = S.render({"instruction": "Add.", "input": "2, 2", "output": "4"}, "alpaca", BYTES, train_on="completion")
    text = BYTES.decode(ex.tokens)
    assert text.startswith("Below is an instruction that describes a task, paired with an input")
    assert "### Instruction:\nAdd.\n\n### Input:\n2, 2\n\n### Response:\n4\n" in text
    assert _learned(ex) == "4\n"
    ex = S.render({"text": "abc"}, "text", BYTES, train_on="all")
    assert ex.tokens.tolist() == list(b"abc\n") and ex.targets.tolist() == [False, True, True, True]


@pytest.mark.parametrize(
    "train_on, learned",
    [
        ("assistant", "yo<|im_end|>\ndone<|im_end|>\n"),
        ("last", "done<|im_end|>\n"),
    ],
)
def test_messages_learn_exactly_the_assistant_turns(train_on, learned):
    ex = S.render(
        {"messages": CHAT}, "messages", BYTES, train_on=train_on, template=S.ChatTemplate(S.DEFAULT_CHAT_TEMPLATE)
    )
    assert BYTES.decode(ex.tokens) == S.ChatTemplate(S.DEFAULT_CHAT_TEMPLATE).render(CHAT)
    assert _learned(ex) == learned


def test_the_chat_template_renders_as_transformers_does(tmp_path):
    """Our Jinja rendering of a model's template against transformers' `apply_chat_template`, and the
    assistant spans decoded from a real BPE tokenizer's targets."""
    transformers = pytest.importorskip("transformers")
    tok = train_bpe(
        ["<|im_start|>user\nhello there<|im_end|>\n" * 50, "def f(x): return x\n" * 50],
        320,
        tmp_path / "tokenizer.json",
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    fast.chat_template = QWEN2_TEMPLATE
    ours = S.ChatTemplate(QWEN2_TEMPLATE)
    for msgs in (CHAT, CHAT[1:], CHAT[1:3]):
        for gen in (False, True):
            assert ours.render(msgs, add_generation_prompt=gen) == fast.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen
            )
    ex = S.render({"messages": CHAT[1:]}, "messages", tok, train_on="assistant", template=ours)
    assert tok.decode(ex.tokens[ex.targets]) == "yo<|im_end|>\ndone<|im_end|>\n"
    assert tok.decode(ex.tokens).startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_the_eos_is_learned_when_pad_is_eos(tmp_path):
    """A BPE whose end-of-text is also the padding id: the example's EOS stays a target in the batch."""
    tok = train_bpe(["2+2=4 and 3+3=6\n"] * 20, 300, tmp_path / "tok.json")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) + "\n" for i in range(8)))
    data = sft.sft_data(
        data_config(path=str(path), val_fraction=0.2),
        Placement(str(tmp_path / "c")),
        Batching(2, 16, seed=0, eval_batches=1),
        tokenizer=tok,
        template=None,
    )
    assert data.sampler.pad_id == tok.eos_id
    x, y = data.train_batch(0)
    for row in range(2):
        learned = y[row][y[row] != -1].tolist()
        assert learned[-1] == tok.eos_id  # the completion's end is learned
        assert (x[row] == tok.eos_id).sum() > 1  # and the padding after it is the same id, not learned
        assert (y[row] == tok.eos_id).sum() == 1


def test_an_inconsistent_template_is_one_line():
    rewrites = S.ChatTemplate(
        "{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(S.TemplateError, match="renders the first 1 message\\(s\\) differently"):
        S.render({"messages": CHAT[1:3]}, "messages", BYTES, train_on="assistant", template=rewrites)


def _write(tmp_path, records, name="d.jsonl"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _spec(**kw):
    base = dict(
        fmt="auto",
        train_on="auto",
        fields=(),
        template=S.ChatTemplate(S.DEFAULT_CHAT_TEMPLATE),
        block_size=16,
        too_long="drop",
        val_fraction=0.2,
    )
    return ExampleSpec(**{**base, **kw})


def test_too_long_drop_and_truncate_and_counts(tmp_path):
    src = _write(tmp_path, [{"prompt": "p", "completion": "c" * n} for n in (3, 30, 4, 5)])
    lines = []
    train, val, info = load_examples(src, tmp_path / "c1", BYTES, _spec(), log=lines.append)
    assert info["dropped"] == 1 and len(train) + len(val) == 3
    assert any("1 examples longer than block_size + 1 = 17 tokens dropped" in line for line in lines)
    train, val, info = load_examples(src, tmp_path / "c2", BYTES, _spec(too_long="truncate"), log=lines.append)
    assert info["truncated"] == 1 and len(train) + len(val) == 4
    assert max(np.diff(np.r_[train.offsets, val.offsets[1:] + train.offsets[-1]])) <= 17


def test_no_target_at_all_is_one_line(tmp_path):
    src = _write(tmp_path, [{"messages": [{"role": "user", "content": "q"}]}] * 3)
    with pytest.raises(DataError, match="no examples left to learn from"):
        load_examples(src, tmp_path / "c", BYTES, _spec(), log=lambda line: None)


def test_fields_map_and_a_record_in_no_format(tmp_path):
    src = _write(tmp_path, [{"question": "q", "answer": "a"}] * 4)
    with pytest.raises(DataError, match="in no supervised format"):
        load_examples(src, tmp_path / "c", BYTES, _spec(), log=lambda line: None)
    train, val, info = load_examples(
        src,
        tmp_path / "c",
        BYTES,
        _spec(fields=(("completion", "answer"), ("prompt", "question"))),
        log=lambda line: None,
    )
    assert info["fmt"] == "prompt_completion" and len(train) + len(val) == 4
    with pytest.raises(DataError, match="train_on='assistant' does not apply"):
        load_examples(
            src,
            tmp_path / "c",
            BYTES,
            _spec(train_on="assistant", fields=(("completion", "answer"), ("prompt", "question"))),
        )


def test_parquet_and_jsonl_give_the_same_examples(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    records = [{"prompt": f"q{i}", "completion": "a" * (i % 5 + 1)} for i in range(20)]
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "pq" / "d.parquet")
    (tmp_path / "js").mkdir()
    _write(tmp_path / "js", records, "d.jsonl")
    a = load_examples(str(tmp_path / "pq"), tmp_path / "c", BYTES, _spec(), log=lambda line: None)
    b = load_examples(str(tmp_path / "js"), tmp_path / "c", BYTES, _spec(), log=lambda line: None)

    def examples(train, val):  # the split hashes the file name, so compare the examples of both splits
        return sorted(
            (s.tokens[s.offsets[i] : s.offsets[i + 1]].tobytes(), s.targets[s.offsets[i] : s.offsets[i + 1]].tobytes())
            for s in (train, val)
            for i in range(len(s))
        )

    assert examples(*a[:2]) == examples(*b[:2]) and len(examples(*a[:2])) == 20


def test_the_cache_is_reused_and_keyed_by_content(tmp_path, monkeypatch):
    src = _write(tmp_path, [{"prompt": "p", "completion": "c" * (i + 1)} for i in range(10)])
    load_examples(src, tmp_path / "c", BYTES, _spec(), log=lambda line: None)
    calls = []
    monkeypatch.setattr(S, "render", lambda *a, **k: calls.append(1))
    import functrain.data.examples as E

    monkeypatch.setattr(E, "render", lambda *a, **k: calls.append(1))
    load_examples(src, tmp_path / "c", BYTES, _spec(), log=lambda line: None)
    assert not calls  # read back, not rendered again
    monkeypatch.undo()
    _write(tmp_path, [{"prompt": "p", "completion": "x"}] * 10)  # other content: a new cache entry
    train, val, _ = load_examples(src, tmp_path / "c", BYTES, _spec(), log=lambda line: None)
    assert set(BYTES.decode(train.tokens).replace("p", "").replace("\n", "")) == {"x"}


def _sft(tmp_path, packing, n=40, batch_size=8):
    src = _write(tmp_path, [{"prompt": f"q{i}:", "completion": "z" * (i % 9 + 1)} for i in range(n)])
    cfg = data_config(path=src, packing=packing, val_fraction=0.1)
    return sft.sft_data(
        cfg,
        Placement(str(tmp_path / "c"), log=lambda line: None),
        Batching(batch_size, 32, seed=3, eval_batches=8),
        tokenizer=BYTES,
        template=None,
    )


@pytest.mark.parametrize("packing", [False, True])
def test_every_example_once_per_epoch_and_any_world_sees_the_same_batches(tmp_path, packing):
    data = _sft(tmp_path, packing)
    s = data.sampler
    per_epoch = [sorted(i for j in range(s.rows_per_epoch) for i in s._rows(e)[j]) for e in (0, 1)]
    assert per_epoch[0] == per_epoch[1] == list(range(len(data.train)))
    assert [r for r in s._rows(0)] != [r for r in s._rows(1)]  # shuffled per epoch
    for step in (0, 3, 7):
        whole = s.batch(step)
        halves = [s.batch(step, rank=r, world=2) for r in range(2)]
        for k in range(len(whole)):
            assert torch.equal(whole[k], torch.cat([h[k] for h in halves]))
    assert data.position(int(2 * s.steps_per_epoch) + 1)["epoch"] == 2


def test_packing_fills_rows_and_every_target_is_kept(tmp_path):
    padded, packed = _sft(tmp_path / "a", False), _sft(tmp_path / "b", True)
    assert packed.sampler.rows_per_epoch < padded.sampler.rows_per_epoch / 2
    assert packed.efficiency()[1] > 2 * padded.efficiency()[1]

    def targets(d):
        return sum(int((b[1] != -1).sum()) for b in (d.train_batch(s) for s in range(int(d.steps_per_epoch))))

    assert targets(packed) <= packed.train.target_count()
    x, y, pos = packed.train_batch(0)
    starts = (pos == 0).sum(1)
    assert (starts >= 2).all()  # several documents per row (and the padding after them)


def test_the_validation_batches_cover_every_validation_example(tmp_path):
    data = _sft(tmp_path, False, n=80, batch_size=4)
    batches = data.eval_sets()
    counted = sum(int((b[1] != -1).sum()) for b in batches)
    assert counted == data.val.target_count() and len(batches) == -(-len(data.val) // 4)


def test_the_data_record_names_the_files_and_changes_with_them(tmp_path):
    data = _sft(tmp_path, False)
    before = data.record()
    ((rel, size, sha),) = before["sources"]["data"]["files"]
    assert rel == "d.jsonl" and size > 0 and len(sha) == 64
    assert before["sources"]["data"]["kind"].startswith("examples:prompt_completion:completion")
    src = _write(tmp_path, [{"prompt": "other", "completion": "z"}] * 40)
    again = sft.sft_data(
        data_config(path=src),
        Placement(str(tmp_path / "c"), log=lambda line: None),
        Batching(8, 32, seed=3, eval_batches=1),
        tokenizer=BYTES,
        template=None,
    )
    assert again.record() != before  # a resume on it stops in one line (trainer.restore)


def test_epochs_set_the_steps_from_the_tasks_steps_per_epoch():
    from functrain import config_checks
    from functrain.task import Batches
    from functrain.trainer import main, validate

    def task(per_epoch):
        return type("T", (), {"data": Batches(None, None, steps_per_epoch=per_epoch)})()

    config = ConfigDict({"epochs": 2.5, "steps": 1})
    main._steps_from_epochs(config, task(10.2), validate)
    assert config.steps == 26  # ceil(2.5 x 10.2)
    config = ConfigDict({"epochs": 1.0, "steps": 1})
    with pytest.raises(config_checks.ConfigError, match="this data has no epochs"):
        main._steps_from_epochs(config, task(None), validate)


def test_a_template_that_renders_the_bos_gives_one_bos(tmp_path):
    """The tokenizer adds no special token of its own: a template's `bos_token` is the only BOS."""
    tok = train_bpe(["hello there\n"] * 20, 300, tmp_path / "tok.json")
    bos = "<|endoftext|>"  # the BPE's one special token, standing in for a BOS
    template = S.ChatTemplate("{{ bos_token }}" + S.DEFAULT_CHAT_TEMPLATE, {"bos_token": bos})
    ex = S.render({"messages": CHAT[1:3]}, "messages", tok, train_on="assistant", template=template)
    assert ex.tokens[0] == tok.eos_id and int((ex.tokens == tok.eos_id).sum()) == 1
    plain = S.render({"prompt": "hello", "completion": " there"}, "prompt_completion", tok, train_on="completion")
    assert plain.tokens[0] != tok.eos_id  # no BOS where no template renders one


def test_packing_under_context_parallelism_is_one_line():
    from functrain.config_checks import ConfigError
    from functrain.models import lm_data

    config = ConfigDict({"data": {"packing": True}})
    lm_data.check_packing(config, type("Ctx", (), {"cp_world": 1})())  # no cp axis: fine
    with pytest.raises(ConfigError, match="context parallelism splits each row"):
        lm_data.check_packing(config, type("Ctx", (), {"cp_world": 2})())


@pytest.mark.parametrize(
    "record", [{"prompt": "2+2=", "completion": "4"}, {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
)
def test_a_bpe_trained_for_a_fresh_model_over_supervised_records_is_one_line(tmp_path, record):
    """`data.tokenizer=auto` (a fresh model) and `bpe:N` train on plain text: over prompt/completion or pairs they
    stop in one line naming the tokenizers that work; bytes work."""
    from functrain.config_checks import ConfigError
    from functrain.models import lm_data

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(record) + "\n")
    config = ConfigDict({"data": data_config()})
    config.data.path = str(path)
    for spec in ("auto", "bpe:300"):
        config.data.tokenizer = spec
        with pytest.raises(ConfigError, match=r"a BPE trains on plain text, .* records; give the model's tokenizer"):
            lm_data.tokenizer_of(config, None, tmp_path, fresh_vocab=300, key="init_from")
    config.data.tokenizer = "bytes"
    assert lm_data.tokenizer_of(config, None, tmp_path, fresh_vocab=300, key="init_from") is None


def test_messages_that_name_the_real_problem(tmp_path):
    """An empty file, a null field and examples with nothing to learn: each says what it is, not something else."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="holds no record") as err:
        supervised_format(data_config(path=str(empty)))
    assert "text" not in str(err.value).split(";")[0]
    with pytest.raises(DataError, match=r"^field 'completion' is null"):
        S.render({"prompt": "p", "completion": None}, "prompt_completion", BYTES, train_on="completion")
    with pytest.raises(DataError, match=r"^no field 'completion'"):
        S.render({"prompt": "p"}, "prompt_completion", BYTES, train_on="completion")
    nulls = _write(tmp_path / "nulls", [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": None}])
    with pytest.raises(DataError, match=r"^d\.jsonl:1: field 'completion' is null"):  # the record named in a run
        load_examples(nulls, tmp_path / "c", BYTES, _spec(fmt="prompt_completion"), log=lambda line: None)
    src = _write(tmp_path, [{"messages": [{"role": "user", "content": "q"}]}] + [{"messages": CHAT}] * 4)
    lines = []
    load_examples(src, tmp_path / "c", BYTES, _spec(fmt="messages", block_size=256), log=lines.append)
    (line,) = [line for line in lines if "left out" in line]
    assert line == "examples: 1 with no token to learn left out (data.train_on)"


def _spread(tmp_path, n=64):
    """Prompt/completion records of 10 to ~110 bytes, most short: batches of 4 fall into each row length."""
    size = [
        4 + (i * 7) % 16 if i % 10 < 7 else 30 + (i * 13) % 30 if i % 10 < 9 else 60 + (i * 17) % 45 for i in range(n)
    ]
    return _write(tmp_path, [{"prompt": f"q{i}: ", "completion": "x" * k} for i, k in enumerate(size)])


def _padded(tmp_path, src):
    return sft.sft_data(
        data_config(path=src, val_fraction=0.1, packing=False),
        Placement(str(tmp_path / "c")),
        Batching(4, 128, seed=0, eval_batches=2),
        tokenizer=BYTES,
        template=None,
    )


def test_padded_rows_are_the_batchs_longest_example_rounded_up_to_a_row_length(tmp_path):
    """Each padded batch is as long as its longest example rounded up to 32, 64 or 128 (the block), the same length
    on every rank; the rows are the block-long rows cut there (nothing real is cut)."""
    assert sft.row_lengths(128) == (32, 64, 128) and sft.row_lengths(96) == (32, 64, 96)
    data = _padded(tmp_path, _spread(tmp_path))
    s = data.sampler
    seen = set()
    for step in range(int(data.steps_per_epoch)):
        x, y = data.train_batch(step)
        rows = [s._rows(0)[j] for j in range(step * 4, step * 4 + 4)]
        longest = max(int(s.examples.lengths[r[0]]) for r in rows)
        assert x.shape[1] == next(n for n in (32, 64, 128) if n >= longest) >= longest
        halves = [s.batch(step, rank=r, world=2) for r in (0, 1)]
        assert all(h[0].shape[1] == x.shape[1] for h in halves)
        assert torch.equal(torch.cat([h[0] for h in halves]), x) and torch.equal(torch.cat([h[1] for h in halves]), y)
        seen.add(x.shape[1])
    assert seen == {32, 64, 128}
    targets, real = data.efficiency()
    assert real > float(s.examples.lengths.sum()) / (s.rows_per_epoch * 128)  # fuller than rows of the whole block
    assert {v[0].shape[1] for v in data.eval_sets()} <= {32, 64, 128}


def test_padded_batches_compile_one_graph_per_row_length(tmp_path, tiny_gpt, gpt_loss_fn):
    """The compile contract of padded rows: each row length compiles once (here the three of block 128), then no
    step recompiles; and the loss of a batch is the same at its length as padded to the whole block."""
    from torch._dynamo.utils import counters

    from functrain import init_state, make_train_step, optim
    from functrain.models import lm

    data = _padded(tmp_path, _spread(tmp_path))
    model = tiny_gpt(vocab_size=256, block_size=128)
    opt = optim.adamw(1e-3)
    step = make_train_step(
        gpt_loss_fn(model), opt, compile_options={"backend": "aot_eager"}, count_targets=lm.count_targets()
    )
    state = init_state(model, opt)
    counters.clear()
    state, _ = step(state, data.train_batch(0))
    first = counters["stats"]["unique_graphs"]
    lengths = {data.train_batch(0)[0].shape[1]}
    for s in range(1, 12):
        batch = data.train_batch(s)
        lengths.add(batch[0].shape[1])
        state, _ = step(state, batch)
    assert len(lengths) == 3 and counters["stats"]["unique_graphs"] == first + 2, dict(counters["stats"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for s in range(12, 24):
            state, _ = step(state, data.train_batch(s))
    evaluate = make_train_step(gpt_loss_fn(model), optim.sgd(0.0), compile=False, count_targets=lm.count_targets())
    x, y = data.train_batch(3)
    full = (
        torch.nn.functional.pad(x, (0, 128 - x.shape[1])),
        torch.nn.functional.pad(y, (0, 128 - y.shape[1]), value=-1),
    )
    plain = init_state(model, optim.sgd(0.0))
    _, short = evaluate(plain, (x, y))
    _, long = evaluate(init_state(model, optim.sgd(0.0)), full)
    assert short["targets"] == long["targets"] and torch.allclose(short["loss"], long["loss"], rtol=1e-6, atol=0)
