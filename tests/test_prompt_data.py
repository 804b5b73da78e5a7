"""Prompts as data (`functrain.data.prompts`): records found as prompts, a step's prompts split over ranks as the
whole batch's, each prompt once per epoch, messages rendered with the generation prompt, bad records in one line;
the built-in additions task and its rewards."""

from __future__ import annotations

import json

import ml_collections
import pytest

from functrain.data import additions, entry, prompts
from functrain.data.errors import DataError
from functrain.data.placement import Batching, Placement
from functrain.data.supervised import chat_template_of
from functrain.data.tokenizer import ByteTokenizer
from functrain.trainer import defaults


def _data(path, **overrides):
    d = defaults.data_config(path=str(path), **overrides)
    return d


def _write(tmp_path, records):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompt_only_records_and_the_additions_task_are_prompts(tmp_path):
    path = _write(tmp_path, [{"prompt": "2+2=", "answer": "4"}])
    assert entry.supervised_format(_data(path)) == "prompts"
    assert entry.supervised_format(_data("additions")) == "prompts"
    both = _write(tmp_path, [{"prompt": "2+2=", "completion": "4"}])
    assert entry.supervised_format(_data(both)) == "prompt_completion"


def test_a_steps_prompts_split_over_ranks_as_the_whole_batch_each_once_per_epoch(tmp_path):
    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(12)]
    path = _write(tmp_path, records)
    batching = Batching(batch_size=4, block_size=16, seed=3)

    def made(rank, world):
        place = Placement(str(tmp_path / "cache"), dp_rank=rank, dp_world=world, log=lambda line: None)
        return entry.run_data(_data(path), place, batching)

    one, halves = made(0, 1), [made(r, 2) for r in range(2)]
    assert isinstance(one, prompts.PromptData) and one.steps_per_epoch == 3
    for step in range(6):
        whole = one.prompts_at(step)
        parts = [h.prompts_at(step) for h in halves]
        assert [i for p in parts for i in p.places] == whole.places == [0, 1, 2, 3]
        assert [x for p in parts for x in p.prompts] == whole.prompts
        assert [a for p in parts for a in p.fields["answer"]] == whole.fields["answer"]
        assert halves[1].prompts_at(step, whole=True) == whole
    for epoch in range(2):  # each prompt once per epoch, in an order of the epoch's own
        seen = [p for s in range(3 * epoch, 3 * epoch + 3) for p in one.prompts_at(s).prompts]
        assert sorted(seen) == sorted(r["prompt"] for r in records)
    first = [p for s in range(3) for p in one.prompts_at(s).prompts]
    assert first != [p for s in range(3, 6) for p in one.prompts_at(s).prompts]
    assert one.prompts_at(0).ids[0] == list(one.prompts_at(0).prompts[0].encode())


def test_messages_prompts_end_with_the_generation_prompt(tmp_path):
    path = _write(tmp_path, [{"prompt": [{"role": "user", "content": "hi"}], "level": 1}])
    place = Placement(str(tmp_path / "cache"), log=lambda line: None)
    tok = ByteTokenizer()
    d = prompts.prompt_data(_data(path), place, Batching(1, 64), tokenizer=tok, template=chat_template_of(None))
    text = bytes(d.ids[0]).decode()
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text and d.fields[0] == {"level": 1}


@pytest.mark.parametrize(
    "records, batch, message",
    [
        ([{"question": "2+2="}], 2, "record 0 of"),
        ([{"prompt": 3}], 2, "prompt 0 is a int; give a text or a list of messages"),
        ([{"prompt": "a"}], 3, "batch_size=3 prompts do not split over 2 data-parallel ranks"),
    ],
)
def test_bad_prompts_are_one_line(tmp_path, records, batch, message):
    path = _write(tmp_path, records)
    place = Placement(str(tmp_path / "cache"), dp_rank=0, dp_world=2, log=lambda line: None)
    with pytest.raises(DataError, match="^" + message.split(" of")[0]) as err:
        prompts.prompt_data(
            _data(path, format="prompts"), place, Batching(batch, 16), tokenizer=ByteTokenizer(), template=None
        )
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_additions_rewards():
    records = additions.records(50)
    assert records == additions.records(50) and all(int(r["answer"]) < 200 for r in records)
    assert all(eval(r["prompt"][:-1]) == int(r["answer"]) for r in records)  # noqa: S307 (our own sums)
    assert additions.correct(["1+2="] * 3, ["3\n", " 3", "4"], answer=["3"] * 3) == [1.0, 1.0, 0.0]
    assert additions.formatted([""] * 4, ["42\n", "4x\n", "42", ""]) == [1.0, 0.5, 0.5, 0.0]


def test_a_config_names_prompts_as_a_format():
    c = ml_collections.ConfigDict({"format": "prompts"})
    assert entry.supervised_format(c) == "prompts"
