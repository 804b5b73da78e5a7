"""Special tokens read as transformers reads them, and supervised examples tokenized as TRL's `SFTTrainer`
tokenizes them, on tokenizer directories shaped as Qwen2.5-Instruct, Llama-3-Instruct and DeepSeek-V3 ship
them (tests/_tokenizer_dirs.py): the end token each learns, BOS, `{% generation %}` spans, template files."""

from __future__ import annotations

import json
import tempfile

import _tokenizer_dirs as dirs
import pytest

from functrain.data import Batching, Placement, chat_template, sft
from functrain.data import supervised as S
from functrain.data.errors import DataError
from functrain.data.tokenizer import ByteTokenizer, HFTokenizer
from functrain.trainer.defaults import data_config

transformers = pytest.importorskip("transformers")
BYTES = ByteTokenizer()

PAIRS = [
    {"prompt": "What is 2+2?", "completion": " It is 4."},
    {"prompt": "def add(a, b):", "completion": "\n    return a + b"},
    {"prompt": "hello there, how are", "completion": " you today?"},
    {"prompt": "The quick brown fox jumps over the la", "completion": "zy dog."},  # a word cut: tokens merge
    {"prompt": "json.dumps", "completion": " serializes an object.<|im_end|>"},
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "how are you today?"},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "return a + b"},
    ],
]


@pytest.fixture(scope="module")
def made():
    """{(style, training): directory}, written once for the module."""
    root = tempfile.mkdtemp()
    return {(s, t): dirs.write(f"{root}/{s}-{t}", s, training=t) for s in dirs.STYLES for t in (False, True)}


def _trl(directory, records, **options):
    """TRL's SFTTrainer's tokenized dataset of `records` (its own preprocessing, on a tiny model)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    args = SFTConfig(output_dir=tempfile.mkdtemp(), report_to=[], bf16=False, use_cpu=True, max_length=None, **options)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok)
    return [(row["input_ids"], [lab != -100 for lab in row["labels"]]) for row in trainer.train_dataset]


@pytest.mark.parametrize("style", dirs.STYLES)
def test_special_tokens_are_transformers(made, style):
    d = made[(style, False)]
    ours = HFTokenizer(d)
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    st = ours.special
    assert (st.bos, st.eos, st.pad) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert (st.bos_id, st.eos_id, st.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert ours.eos_id == ref.eos_token_id
    for text in ("def add(a, b):", "hello there", " x"):  # what the tokenizer adds around a text: BOS or nothing
        assert list(st.prefix) + ours.encode(text).tolist() + list(st.suffix) == ref(text)["input_ids"]
    generation = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert set(st.stop_ids) == {ref.eos_token_id, *([generation] if isinstance(generation, int) else generation)}
    assert st.stop_ids[0] == ref.eos_token_id
    assert S.chat_template_of(d, st.template_vars()).render(CHATS[0]) == ref.apply_chat_template(
        CHATS[0], tokenize=False
    )


@pytest.mark.parametrize("style", dirs.STYLES)
def test_prompt_completion_and_text_as_trl(made, style, tmp_path):
    """Tokens and targets equal TRL's, but where the prompt's last token and the completion's first merge when
    tokenized together: functrain tokenizes them apart (the prompt the model sees at inference), TRL together.
    The test counts those and expects exactly them."""
    d = made[(style, False)]
    tok = HFTokenizer(d)
    ref = _trl(d, PAIRS)
    merged = sum(
        tok.encode(p["prompt"]).tolist() + tok.encode(p["completion"]).tolist()
        != tok.encode(p["prompt"] + p["completion"]).tolist()
        for p in PAIRS
    )
    assert merged == 2  # the word cut inside "lazy", and ":" + "\n" (the split regexes keep a newline with punctuation)
    differ = 0
    for record, (ids, learned) in zip(PAIRS, ref):
        ex = S.render(record, "prompt_completion", tok, train_on="completion")
        if ex.tokens.tolist() != ids:
            differ += 1
            continue
        assert ex.targets[1:].tolist() == learned[1:]
        assert ex.tokens[-1] == tok.special.eos_id and ex.targets[-1]  # the end token TRL and the model use
    assert differ == merged
    texts = [{"text": p["prompt"] + p["completion"]} for p in PAIRS]
    for record, (ids, _) in zip(texts, _trl(d, texts)):
        ex = S.render(record, "text", tok, train_on="all")
        assert ex.tokens.tolist() == ids


@pytest.mark.parametrize("style", dirs.STYLES)
def test_generation_blocks_are_the_targets_as_trl(made, style):
    """The `*_training` templates: tokens and the assistant mask equal TRL's `assistant_only_loss=True` (transformers'
    `return_assistant_tokens_mask`); with every token learned, the model's own template equals TRL's default."""
    d = made[(style, True)]
    tok = HFTokenizer(d)
    template = S.chat_template_of(d, tok.special.template_vars())
    assert template.has_generation
    records = [{"messages": m} for m in CHATS]
    for record, (ids, learned) in zip(records, _trl(d, records, assistant_only_loss=True)):
        ex = S.render(record, "messages", tok, train_on="assistant", template=template)
        assert ex.tokens.tolist() == ids
        assert ex.targets.tolist() == learned and any(learned)
        last = S.render(record, "messages", tok, train_on="last", template=template)
        assert 0 < last.targets.sum() < ex.targets.sum() or len(record["messages"]) == 2
    plain = made[(style, False)]
    template = S.chat_template_of(plain, tok.special.template_vars())
    for record, (ids, _) in zip(records, _trl(plain, records)):
        ex = S.render(record, "messages", HFTokenizer(plain), train_on="all", template=template)
        assert ex.tokens.tolist() == ids


def test_the_turns_spans_and_the_generation_blocks_learn_what_each_template_says(made):
    """Qwen2.5's template (one message at a time: the header is prompt) learns each answer and its end of turn;
    its training template's `{% generation %}` blocks also hold the newline after the header."""
    tok = HFTokenizer(made[("qwen2.5", False)])
    spans = S.chat_template_of(made[("qwen2.5", False)], tok.special.template_vars())
    blocks = S.chat_template_of(made[("qwen2.5", True)], tok.special.template_vars())
    a = S.render({"messages": CHATS[1]}, "messages", tok, train_on="assistant", template=spans)
    b = S.render({"messages": CHATS[1]}, "messages", tok, train_on="assistant", template=blocks)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert tok.decode(a.tokens[a.targets]) == "how are you today?<|im_end|>\nreturn a + b<|im_end|>\n"
    assert tok.decode(b.tokens[b.targets]) == "\nhow are you today?<|im_end|>\n\nreturn a + b<|im_end|>\n"


def test_a_template_file_renders_with_the_tokenizers_special_tokens(made, tmp_path):
    d = made[("llama3", True)]
    path = tmp_path / "llama3_training.jinja"
    path.write_text(dirs.trl_template("llama3", training=True))
    tok = HFTokenizer(d)
    template = chat_template(data_config(chat_template=str(path)), None, tok)
    assert template.render(CHATS[0]).startswith("<|begin_of_text|><|start_header_id|>user")
    assert template.has_generation and template.name == str(path)
    ex = S.render({"messages": CHATS[0]}, "messages", tok, train_on="assistant", template=template)
    assert tok.decode(ex.tokens[ex.targets]) == "It is 4.<|eot_id|>"


def test_a_vocabulary_without_eos_is_one_line_naming_the_key(tmp_path):
    """A DeepSeek-style vocabulary with no tokenizer_config.json: no known end-of-text name, so examples would end
    on nothing; `data.eos_token` names it."""
    d = dirs.write(tmp_path / "bare", "deepseek", config=False)
    tok = HFTokenizer(d)
    assert tok.eos_id is None
    with pytest.raises(DataError, match="--config.data.eos_token") as err:
        S.render(PAIRS[0], "prompt_completion", tok, train_on="completion")
    assert "\n" not in str(err.value)
    tok = HFTokenizer(d, eos_token=dirs.E)
    ex = S.render(PAIRS[0], "prompt_completion", tok, train_on="completion")
    assert ex.tokens[-1] == tok.eos_id == tok._tok.token_to_id(dirs.E) and ex.targets[-1]
    with pytest.raises(DataError, match="'<nope>', which the tokenizer's vocabulary does not hold"):
        HFTokenizer(d, eos_token="<nope>")


def test_the_sft_data_pads_with_pad_and_stops_at_every_eos(made, tmp_path):
    d = made[("qwen2.5", False)]
    tok = HFTokenizer(d)
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS * 4))
    lines = []
    data = sft.sft_data(
        data_config(path=str(path), val_fraction=0.2),
        Placement(str(tmp_path / "c"), log=lines.append),
        Batching(2, 32, seed=0, eval_batches=1),
        tokenizer=tok,
        template=None,
    )
    assert data.sampler.pad_id == tok.special.pad_id != tok.eos_id  # <|endoftext|>, not the <|im_end|> learned
    assert any("ends with <|im_end|>" in line and "tokenizer_config.json" in line for line in lines)
    answer = tok.encode("It is 4.").tolist() + [tok.special.stop_ids[1]] + tok.encode(" more").tolist()
    assert data.answer(answer) == "It is 4."  # generation_config.json's <|endoftext|> stops it too


def test_template_errors_name_the_file_and_line():
    refuses = "{% for m in messages %}{{ raise_exception('no system role') if m['role'] == 'system' }}{% endfor %}"
    with pytest.raises(S.TemplateError, match=r"^the chat template refused a conversation: no system role"):
        S.render(_chat(CHATS[1]), "messages", BYTES, train_on="assistant", template=S.ChatTemplate(refuses))
    broken = "{% for m in messages %}\n{{ m['content'] }}\n{{ m.content.nope() }}{% endfor %}"
    with pytest.raises(S.TemplateError, match=r"^the chat template failed at t\.jinja:3 "):
        template = S.ChatTemplate(broken, name="t.jinja")
        S.render(_chat(CHATS[0]), "messages", BYTES, train_on="assistant", template=template)
    with pytest.raises(S.TemplateError, match=r"t\.jinja:2: not a Jinja template"):
        S.ChatTemplate("{% for m in messages %}\n{% endif %}", name="t.jinja")


def _chat(messages):
    return {"messages": messages}


def test_generate_until_stops_at_every_stop_id_of_the_directory(made):
    """Qwen2.5's generation_config.json stops at <|endoftext|> as well as at its EOS <|im_end|>: so does
    generate_until (a model that always predicts <|endoftext|> gives an empty answer, not max_gen_toks tokens)."""
    import torch

    from functrain import eval as fe

    tok = HFTokenizer(made[("qwen2.5", False)])
    other = tok.special.stop_ids[1]
    assert other != tok.eos_id

    def logits(params, model_state, ids):
        out = torch.zeros(*ids.shape, tok.vocab_size)
        out[..., other] = 5.0
        return out

    model = fe.EvalModel(logits, tok, block_size=32, prefix_id=tok.eos_id, eos_id=tok.eos_id)
    (text,) = fe.generate_until(model, {}, [("hello there", {"max_gen_toks": 8})])
    assert text == "<|endoftext|>"  # the stop token itself, then no more
