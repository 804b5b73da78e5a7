"""Data keyed by content: the files' sha256 key the token caches, checkpoints record the data, and a
resume on other data (a shard deleted, appended to, edited in place with its mtime put back) stops in
one line unless told to go on."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from functrain import checkpoint as ckpt
from functrain.data import Placement, TextOptions, digests, load_dataset, open_token_cache, tokenize
from functrain.data.errors import DataError
from functrain.data.record import changes, check_resume, source_record

REPO = Path(__file__).resolve().parents[1]
_WORDS = "def return class import self if else for while in not and or None True".split()


def _docs(n, seed):
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(5, 40))) for _ in range(n)]


def _shards(root: Path, n=3, docs=200) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"w{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(docs, i)))
    return root


def _edit_in_place(path: Path) -> None:
    """Changes bytes without changing the size, then puts the mtime back (the case a size+mtime key misses)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    i = data.index(b"return")
    data[i : i + 6] = b"RETURN"
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def _quiet(line):
    pass


def test_digests_see_an_edit_that_keeps_size_and_mtime_and_hash_only_what_changed(tmp_path, monkeypatch):
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_text("return x\n" * 100)
    files[1].write_text("if y\n" * 100)
    memo = tmp_path / "memo.json"
    first = digests.file_digests(files, memo)
    assert first == [digests.file_digest(f) for f in files]
    hashed = []
    real = digests.file_digest
    monkeypatch.setattr(digests, "file_digest", lambda p: hashed.append(Path(p).name) or real(p))
    assert digests.file_digests(files, memo) == first and hashed == []  # remembered: nothing read
    _edit_in_place(files[0])
    second = digests.file_digests(files, memo)
    assert hashed == ["a.txt"]  # its ctime moved: read again
    assert second[0] != first[0] and second[0] == real(files[0]) and second[1] == first[1]


def test_shard_cache_is_keyed_by_content(tmp_path):
    src = _shards(tmp_path / "src")
    out = tokenize(str(src), Placement(tmp_path / "cache", log=_quiet), TextOptions(val_fraction=0.1, workers=1))
    before_train, _, _ = open_token_cache(out)
    bins = {p: p.stat().st_mtime_ns for p in (out / "train").glob("*.bin")}

    os.utime(src / "w1.jsonl")  # touched: same bytes, so the tokens are kept, not written again
    out2 = tokenize(str(src), Placement(tmp_path / "cache", log=_quiet), TextOptions(val_fraction=0.1, workers=1))
    assert out2 == out and {p: p.stat().st_mtime_ns for p in bins} == bins

    _edit_in_place(src / "w0.jsonl")
    lines = []
    tokenize(str(src), Placement(tmp_path / "cache", log=lines.append), TextOptions(val_fraction=0.1, workers=1))
    assert any("1 of 3 shards" in line for line in lines), lines  # only the edited shard again
    train, val, info = open_token_cache(out)
    fresh_train, fresh_val, _ = open_token_cache(
        tokenize(str(src), Placement(tmp_path / "fresh", log=_quiet), TextOptions(val_fraction=0.1, workers=1))
    )
    assert np.array_equal(train[0 : len(train)], fresh_train[0 : len(fresh_train)])
    assert np.array_equal(val[0 : len(val)], fresh_val[0 : len(fresh_val)])
    assert not np.array_equal(train[0 : len(train)], before_train[0 : len(before_train)])
    assert [c[2] for c in info["content"]] == [digests.file_digest(src / f"w{i}.jsonl") for i in range(3)]


def test_text_cache_is_keyed_by_content(tmp_path):
    root = tmp_path / "text"
    root.mkdir()
    for i in range(4):
        (root / f"f{i}.py").write_text("\n".join(_docs(30, i)))
    first = load_dataset(str(root), Placement(tmp_path / "cache"))
    old = np.array(first.train)
    target = next(
        f for f in sorted(root.iterdir()) if b"return" in f.read_bytes() and f.name not in first.info["val_files"]
    )
    _edit_in_place(target)
    again = load_dataset(str(root), Placement(tmp_path / "cache"))
    fresh = load_dataset(str(root), Placement(tmp_path / "fresh"))
    assert np.array_equal(np.asarray(again.train), np.asarray(fresh.train))
    assert not np.array_equal(np.asarray(again.train), old)
    assert again.info["content"] != first.info["content"]


def test_changes_name_what_differs():
    a = source_record("shards", "bytes", [["a.jsonl", 10, "1" * 64], ["b.jsonl", 20, "2" * 64]])
    assert changes({"sources": {"d": a}}, {"sources": {"d": a}}) == []
    assert changes(None, {"sources": {"d": a}}) == [] and changes({}, {"sources": {"d": a}}) == []
    b = source_record("shards", "tokenizers:ff", [["a.jsonl", 10, "3" * 64], ["c.jsonl", 5, "4" * 64]])
    (line,) = changes({"sources": {"d": a}}, {"sources": {"d": b}})
    assert line == (
        "source 'd': tokenizer bytes -> tokenizers:ff; 1 file removed (b.jsonl); 1 file added (c.jsonl); "
        "1 changed (a.jsonl: same size, other bytes)"
    )
    assert changes({"sources": {"d": a}}, {"sources": {"e": a}}) == ["source 'd' is gone", "source 'e' is new"]
    with pytest.raises(DataError, match=r"allow_changed=True"):
        check_resume({"sources": {"d": a}}, {"sources": {"d": b}}, 10, allow=False)
    assert "going on" in check_resume({"sources": {"d": a}}, {"sources": {"d": b}}, 10, allow=True)
    assert check_resume({"sources": {"d": a}}, {"sources": {"d": a}}, 10, allow=False) is None
    with pytest.raises(DataError, match=r"batch_size 8 -> 4 rows .* row 40 of the data where the run reached row 80"):
        check_resume({"sources": {"d": a}, "batch_size": 8}, {"sources": {"d": a}, "batch_size": 4}, 10, allow=False)
    assert check_resume({"sources": {"d": a}}, {"sources": {"d": a}, "batch_size": 4}, 10, allow=False) is None


ARGS = [
    "--config=configs/gpt.py:tiny",
    "--config.compile=False",
    "--config.log_every=5",
    "--config.eval_every=1000",
    "--config.eval_batches=1",
    "--config.sample.max_new_tokens=0",
    "--config.checkpoint.every=10",
    "--config.data.val_fraction=0.2",
    "--config.eval.tasks=",
]


def _main(workdir, data, steps, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "functrain.main",
            *ARGS,
            f"--workdir={workdir}",
            f"--config.data.path={data}",
            f"--config.steps={steps}",
            *extra,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_a_resume_on_changed_data_stops_in_one_line_unless_allowed(tmp_path):
    src = _shards(tmp_path / "src")
    run = tmp_path / "run"
    first = _main(run, src, 10)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = ckpt.Manager(str(run / "checkpoints")).custom_metadata(10)["functrain"]["data"]
    assert [f[0] for f in saved["sources"]["data"]["files"]] == ["w0.jsonl", "w1.jsonl", "w2.jsonl"]

    (src / "w2.jsonl").unlink()
    size1 = (src / "w1.jsonl").stat().st_size
    with open(src / "w1.jsonl", "a") as f:
        f.write(json.dumps({"text": "return None"}) + "\n")
    _edit_in_place(src / "w0.jsonl")
    refused = _main(run, src, 20)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("functrain: error:")]
    assert len(errors) == 1, refused.stderr
    for part in (
        "since checkpoint step 10",
        "1 file removed (w2.jsonl)",
        "w0.jsonl: same size, other bytes",
        f"w1.jsonl: {size1:,} -> {(src / 'w1.jsonl').stat().st_size:,} bytes",
        "--config.data.allow_changed=True",
    ):
        assert part in errors[0], errors[0]
    assert ckpt.Manager(str(run / "checkpoints")).all_steps() == [10]  # nothing lost

    allowed = _main(run, src, 20, "--config.data.allow_changed=True")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "the data changed since checkpoint step 10 (source 'data': 1 file removed (w2.jsonl)" in allowed.stdout
    assert "restored checkpoint step 10" in allowed.stdout
    now = ckpt.Manager(str(run / "checkpoints")).custom_metadata(20)["functrain"]["data"]
    assert now["sources"]["data"]["files"] == [
        [f"w{i}.jsonl", (src / f"w{i}.jsonl").stat().st_size, digests.file_digest(src / f"w{i}.jsonl")]
        for i in range(2)
    ]
