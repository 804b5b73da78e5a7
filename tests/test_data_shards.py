"""Parquet/jsonl shards: parallel, resumable tokenization into a sharded cache, and each bad input's
one line (real files written by the tests, real worker processes)."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from functrain.data import (
    ConcatTokens,
    DataError,
    Placement,
    TextOptions,
    load_dataset,
    open_token_cache,
    tokenize,
    train_bpe,
)

REPO = Path(__file__).resolve().parents[1]
_WORDS = "the of and to in is was for on that with by as at from def return class import é ß 中".split()


def _docs(n, seed, lo=5, hi=60):
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(lo, hi))) for _ in range(n)]


def _jsonl(path, docs, gz=False, field="text"):
    lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")


def _corpus(root, n_shards=4, docs=300):
    """A directory with jsonl, jsonl.gz and parquet shards; returns every document."""
    root.mkdir(parents=True, exist_ok=True)
    every = []
    for i in range(n_shards):
        d = _docs(docs, i)
        every += d
        if i % 3 == 0:
            _jsonl(root / f"part{i}.jsonl", d)
        elif i % 3 == 1:
            _jsonl(root / f"part{i}.jsonl.gz", d, gz=True)
        else:
            pq.write_table(pa.table({"text": d, "n": list(range(len(d)))}), root / f"part{i}.parquet")
    return every


def _quiet(line):
    pass


def _cache_dir(cache):
    """The token cache directory under `cache` (beside the digests memo)."""
    (out,) = [p for p in cache.iterdir() if p.name != "digests"]
    return out


def _documents(tokens) -> list[str]:
    """Byte tokens split back into documents (newline-separated)."""
    raw = np.asarray(tokens[0 : len(tokens)]).astype(np.uint8).tobytes().decode("utf-8") + "\n"
    return raw[:-1].split("\n")


def test_shards_tokenize_to_every_document_once_split_between_train_and_val(tmp_path):
    docs = _corpus(tmp_path / "src")
    ds = load_dataset(
        str(tmp_path / "src"), Placement(tmp_path / "cache", log=_quiet), TextOptions(val_fraction=0.1, workers=2)
    )
    assert isinstance(ds.train, ConcatTokens) and ds.vocab_size == 256
    train, val = _documents(ds.train), _documents(ds.val)
    assert sorted(train + val) == sorted(docs)  # every document exactly once, byte for byte
    assert 0.03 < len(val) / len(docs) < 0.2  # ~10% by document
    assert ds.info["documents"] == len(docs) and ds.info["units"] == 4
    # a glob of the same files, and the cache directory itself, read the same tokens
    again = load_dataset(
        str(tmp_path / "src" / "part*"), Placement(tmp_path / "cache2", log=_quiet), TextOptions(val_fraction=0.1)
    )
    assert np.array_equal(again.train[0 : len(again.train)], ds.train[0 : len(ds.train)])
    direct = load_dataset(ds.info["cache_dir"], Placement(tmp_path / "unused"))
    assert np.array_equal(direct.val[0 : len(direct.val)], ds.val[0 : len(ds.val)])


def test_parallel_and_multi_rank_tokenizing_write_the_same_cache_as_one_process(tmp_path):
    _corpus(tmp_path / "src", n_shards=6)
    one = tokenize(str(tmp_path / "src"), Placement(tmp_path / "one", log=_quiet), TextOptions(workers=1))
    two = tokenize(str(tmp_path / "src"), Placement(tmp_path / "two", log=_quiet), TextOptions(workers=2))
    # two ranks sharing the work, each its own process with 1 worker
    code = (
        "import sys; from functrain.data import Placement, TextOptions, tokenize; "
        "tokenize(sys.argv[1], Placement(sys.argv[2], rank=int(sys.argv[3]), world=2), TextOptions(workers=1))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "src"), str(tmp_path / "ranks"), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    shares = [int(log.split("rank ")[1].split(" of 2: ")[1].split(" of ")[0]) for log in logs]
    assert sum(shares) == 6 and min(shares) >= 2, logs  # dealt, not duplicated
    ranks = tmp_path / "ranks" / one.name
    for split in ("train", "val"):
        for f in sorted((one / split).glob("*.bin")):
            assert f.read_bytes() == (two / split / f.name).read_bytes() == (ranks / split / f.name).read_bytes()
    assert "tokenized" in logs[0] and "MB/s" in logs[0]


def test_a_killed_tokenization_keeps_finished_shards_and_completes_on_rerun(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        _jsonl(src / f"s{i:02d}.jsonl", _docs(3000, i))
    code = (
        "import sys; from functrain.data import Placement, TextOptions, tokenize; "
        "tokenize(sys.argv[1], Placement(sys.argv[2]), TextOptions(workers=1))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(src), str(tmp_path / "cache")],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list((tmp_path / "cache").glob("*/done/*.json")):
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    out = _cache_dir(tmp_path / "cache")
    done = len(list((out / "done").glob("*.json")))
    assert 1 <= done < 12 and not (out / "meta.json").exists()  # killed midway: not complete-looking
    lines = []
    again = tokenize(str(src), Placement(tmp_path / "cache", log=lines.append), TextOptions(workers=2))
    assert again == out
    assert f"({done} done earlier)" in lines[0] or f"({done + 1} done earlier)" in lines[0], lines
    assert not list(out.rglob(".*tmp*"))  # the killed run's temporaries are gone
    fresh = tokenize(str(src), Placement(tmp_path / "fresh", log=_quiet), TextOptions(workers=1))
    a, b = open_token_cache(out), open_token_cache(fresh)
    for i in (0, 1):
        assert np.array_equal(a[i][0 : len(a[i])], b[i][0 : len(b[i])])


def test_tokenizing_with_a_bpe_uses_its_end_of_text_and_refuses_another_tokenizers_cache(tmp_path):
    docs = _corpus(tmp_path / "src", n_shards=3)
    tok = train_bpe(docs, 300, tmp_path / "bpe.json")
    ds = load_dataset(
        str(tmp_path / "src"), Placement(tmp_path / "cache", log=_quiet), TextOptions(val_fraction=0.1), tokenizer=tok
    )
    ids = np.asarray(ds.train[0 : len(ds.train)]).astype(np.int64)
    assert ids[-1] != tok.eos_id and (ids == tok.eos_id).sum() > 100  # between documents, none after the last
    first = ids[: int(np.flatnonzero(ids == tok.eos_id)[0])]
    assert tok.decode(first) in docs
    other = train_bpe(docs, 280, tmp_path / "bpe2.json")
    with pytest.raises(DataError) as err:
        load_dataset(ds.info["cache_dir"], Placement(tmp_path / "x"), tokenizer=other)
    assert "written by" in str(err.value) and "\n" not in str(err.value)


def _error(tmp_path, src) -> str:
    with pytest.raises(DataError) as err:
        load_dataset(str(src), Placement(tmp_path / "cache", log=_quiet))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_shards_are_one_line_each_and_leave_nothing_half_written(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "a.jsonl", _docs(50, 0))
    (src / "notes.csv").write_text("a,b\n")
    assert "notes.csv: not a parquet or jsonl shard" in _error(tmp_path, str(src / "*"))
    # a missing text field, in jsonl and in parquet
    _jsonl(tmp_path / "body.jsonl", _docs(5, 1), field="body")
    assert "no field 'text' (fields: body, id)" in _error(tmp_path, tmp_path / "body.jsonl")
    pq.write_table(pa.table({"content": _docs(5, 2)}), tmp_path / "c.parquet")
    assert "no column 'text' (columns: content)" in _error(tmp_path, tmp_path / "c.parquet")
    ok = load_dataset(
        str(tmp_path / "c.parquet"), Placement(tmp_path / "cache", log=_quiet), TextOptions(text_field="content")
    )
    assert len(ok.train) > 0
    # a file named .parquet that is not one
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    assert "not a readable parquet file" in _error(tmp_path, tmp_path / "bad.parquet")
    # an empty shard
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.jsonl").write_text("")
    assert "an empty shard" in _error(tmp_path, tmp_path / "empty")
    # lines that are not JSON: counted, the first named; skipped under the threshold
    lines = [json.dumps({"text": d}) for d in _docs(200, 3)]
    lines[7] = "{not json"
    lines[50] = "[1, 2]"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "b.jsonl").write_text("\n".join(lines) + "\n")
    message = _error(tmp_path, tmp_path / "b")
    assert "2 of 200 lines are not JSON objects (first at" in message and "b.jsonl:8)" in message
    assert "max_bad_line_fraction" in message
    for cache in (tmp_path / "cache").iterdir():  # (and the digests memo) nothing of the failed shards left behind
        assert not list(cache.rglob(".*tmp*"))
    logged = []
    ds = load_dataset(
        str(tmp_path / "b"), Placement(tmp_path / "cache", log=logged.append), TextOptions(max_bad_line_fraction=0.02)
    )
    assert len(_documents(ds.train)) + len(_documents(ds.val)) == 198
    assert any("skipped 2 jsonl lines" in line for line in logged), logged


def test_a_failed_shard_writes_no_token_file_or_marker(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "good.jsonl", _docs(50, 0))
    (src / "zbad.jsonl").write_text("oops\n" * 10)
    with pytest.raises(DataError):
        tokenize(str(src), Placement(tmp_path / "cache", log=_quiet), TextOptions(workers=2))
    out = _cache_dir(tmp_path / "cache")
    names = [p.name for p in out.rglob("*") if p.is_file()]
    assert not any("zbad" in n for n in names), names
    assert not (out / "meta.json").exists()


def test_missing_pyarrow_is_one_line(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["a b c"] * 10}), tmp_path / "p.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert "pip install 'functrain[parquet]'" in _error(tmp_path, tmp_path / "p.parquet")


_PEAK = """
import pathlib, sys
from functrain.data import Placement, TextOptions, tokenize
rss = int(pathlib.Path('/proc/self/statm').read_text().split()[1]) * 4096 // 1024
place = Placement(sys.argv[2], log=lambda line: None)
tokenize(sys.argv[1], place, TextOptions(workers=1), chunk_bytes=int(sys.argv[3]))
hwm = [l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM:')]
print(rss, int(hwm[0].split()[1]))  # VmHWM: this program's peak (ru_maxrss would keep the forking parent's)
"""


def test_tokenizing_memory_is_flat_in_corpus_size(tmp_path):
    budget = 12 << 20  # bytes of RSS growth allowed; the corpus is 10x that
    src = tmp_path / "src"
    src.mkdir()
    block = "".join(json.dumps({"text": d}) + "\n" for d in _docs(2000, 0, 20, 200)).encode()
    copies = 5 * budget // len(block) + 1
    for i in range(2):
        with open(src / f"s{i}.jsonl", "wb") as f:
            for _ in range(copies):
                f.write(block)
    corpus = sum(p.stat().st_size for p in src.iterdir())
    assert corpus >= 10 * budget
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(src), str(tmp_path / "cache"), str(256 << 10)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    before_kb, peak_kb = map(int, out.stdout.split())
    assert (peak_kb - before_kb) * 1024 < budget, (before_kb, peak_kb, corpus)
    train, val, info = open_token_cache(_cache_dir(tmp_path / "cache"))
    assert info["documents"] == 2 * copies * 2000  # it did tokenize the whole corpus


def test_a_spawned_tokenizing_worker_imports_no_torch():
    # what a spawned worker of `python -m functrain.main` imports: the main module again (as __mp_main__)
    # and the token cache, whose functions it runs
    code = (
        "import runpy, sys; runpy.run_module('functrain.main', run_name='__mp_main__'); "
        "import functrain.data.token_cache; assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_dictionary_encoded_and_large_string_columns_are_text(tmp_path):
    docs = _docs(50, 7, lo=1, hi=3)  # few distinct values: what a categorical column holds
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"text": pa.array(docs).dictionary_encode()}), src / "dict.parquet")
    pq.write_table(pa.table({"text": pa.array(docs, type=pa.large_string())}), src / "large.parquet")
    assert pq.read_schema(src / "dict.parquet").field("text").type == pa.dictionary(pa.int32(), pa.string())
    ds = load_dataset(str(src), Placement(tmp_path / "cache", log=_quiet), TextOptions(val_fraction=0.1))
    assert sorted(_documents(ds.train) + _documents(ds.val)) == sorted(docs + docs)


def test_files_that_are_not_shards_are_listed_once_and_the_progress_names_its_bytes(tmp_path):
    docs = _corpus(tmp_path / "src", n_shards=2)
    (tmp_path / "src" / "README.md").write_text("about this data\n")
    (tmp_path / "src" / "notes.json").write_text("{}\n")
    logs = []
    ds = load_dataset(
        str(tmp_path / "src"), Placement(tmp_path / "cache", log=logs.append), TextOptions(val_fraction=0.1)
    )
    assert sorted(_documents(ds.train) + _documents(ds.val)) == sorted(docs)
    skipped = [line for line in logs if "not shards" in line]
    assert len(skipped) == 1 and "2 file(s)" in skipped[0] and "README.md, notes.json" in skipped[0], logs
    assert logs.index(skipped[0]) == 0  # at the start
    assert all("MB of files on disk" in line for line in logs if "MB" in line and "tokeniz" in line), logs


def test_a_small_shard_source_still_gets_a_validation_document(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    docs = _docs(111, 3)
    _jsonl(src / "a.jsonl", docs[:60])
    _jsonl(src / "b.jsonl", docs[60:])
    logs = []
    ds = load_dataset(str(src), Placement(tmp_path / "cache", log=logs.append), TextOptions(val_fraction=1e-6))
    train, val = _documents(ds.train), _documents(ds.val)
    assert val == [docs[0]] and sorted(train + val) == sorted(docs)  # the first train document, moved
    assert any("moved there" in line for line in logs), logs
    again = load_dataset(
        str(src), Placement(tmp_path / "cache", log=logs.append), TextOptions(val_fraction=1e-6)
    )  # the cache as written
    assert _documents(again.val) == val
    one = tmp_path / "one"
    one.mkdir()
    _jsonl(one / "x.jsonl", docs[:1])
    with pytest.raises(DataError, match="1 document: a validation split needs a second one"):
        load_dataset(str(one), Placement(tmp_path / "cache1", log=_quiet))


def _bad_text_files(root):
    """{case: file} of shards whose text is not valid Unicode, and a parquet file corrupt mid-file."""
    root.mkdir(parents=True, exist_ok=True)
    good = _docs(40, 11)
    (root / "surrogate.jsonl").write_text(
        json.dumps({"text": good[0]})
        + "\n"
        + '{"text": "lone \\ud800 surrogate"}\n'
        + json.dumps({"text": good[1]})
        + "\n"
    )
    (root / "bytes.jsonl").write_bytes(
        (json.dumps({"text": good[2]}) + "\n").encode() + b'{"text": "not utf-8 \xff\xfe here"}\n'
    )
    raw = pa.array([good[3].encode(), b"bad \xc3\x28 utf-8", good[4].encode()], type=pa.binary())
    unchecked = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # pyarrow would refuse to build it
    pq.write_table(pa.table({"text": unchecked}), root / "utf8.parquet")
    corrupt = root / "corrupt.parquet"
    pq.write_table(pa.table({"text": _docs(4000, 12)}), corrupt, row_group_size=500, compression="snappy")
    data = bytearray(corrupt.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 2000] = bytes(2000)  # a data page zeroed; the footer intact
    corrupt.write_bytes(bytes(data))
    return {
        "surrogate": root / "surrogate.jsonl",
        "bytes": root / "bytes.jsonl",
        "utf8": root / "utf8.parquet",
        "corrupt": corrupt,
    }


@pytest.mark.parametrize("where", ["file", "directory"])
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_text_is_replaced_and_counted_and_a_corrupt_file_is_one_line(tmp_path, where, workers):
    files = _bad_text_files(tmp_path / "bad")
    for case in ("surrogate", "bytes", "utf8"):
        src = files[case] if where == "file" else tmp_path / f"dir-{case}"
        if where == "directory":
            _corpus(src, n_shards=2, docs=20)
            os.replace(files[case], src / files[case].name)
        logs = []
        ds = load_dataset(
            str(src),
            Placement(tmp_path / f"cache-{case}", log=logs.append),
            TextOptions(val_fraction=0.0, workers=workers),
        )
        text = np.asarray(ds.train[0 : len(ds.train)]).astype(np.uint8).tobytes().decode("utf-8")
        assert "\ufffd" in text, case
        line = [x for x in logs if "by U+FFFD in 1 records" in x]
        assert line and (".jsonl:2" in line[0] or "row 1" in line[0]), (case, logs)
    src = files["corrupt"] if where == "file" else tmp_path / "dir-corrupt"
    if where == "directory":
        _corpus(src, n_shards=2, docs=20)
        os.replace(files["corrupt"], src / "corrupt.parquet")
    with pytest.raises(DataError) as e:
        load_dataset(str(src), Placement(tmp_path / "cache-corrupt", log=_quiet), TextOptions(workers=workers))
    msg = str(e.value)
    assert "\n" not in msg and "corrupt.parquet" in msg and "rows after" in msg and "replace it or remove it" in msg


def test_a_corrupt_file_is_one_line_on_two_ranks(tmp_path):
    files = _bad_text_files(tmp_path / "bad")
    src = tmp_path / "src"
    _corpus(src, n_shards=3, docs=20)
    os.replace(files["corrupt"], src / "corrupt.parquet")
    code = (
        "import sys; from functrain.data import DataError, Placement, TextOptions, tokenize\n"
        "place = Placement(sys.argv[2], rank=int(sys.argv[3]), world=2)\n"
        "try:\n    tokenize(sys.argv[1], place, TextOptions(workers=1), poll_s=0.05)\n"
        "except DataError as e:\n    print('ERROR', e)\n    raise SystemExit(2)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(src), str(tmp_path / "ranks"), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    for out in outs:
        errors = [line for line in out.splitlines() if line.startswith("ERROR")]
        assert len(errors) == 1 and "corrupt.parquet" in errors[0] and "Traceback" not in out, out


def test_rank_zero_reports_the_records_every_rank_replaced(tmp_path):
    """Two ranks tokenizing one cache (threads standing in for processes): rank 0 prints the replaced record
    of the shard rank 1 tokenized (units go largest first to the least loaded rank: the corpus shard to rank 0,
    the small bad one to rank 1); rank 1 prints no such line."""
    import threading

    from functrain.data.token_cache import tokenize

    files = _bad_text_files(tmp_path / "bad")
    src = tmp_path / "two"
    _corpus(src, n_shards=1, docs=20)
    os.replace(files["surrogate"], src / files["surrogate"].name)
    logs = {0: [], 1: []}
    errors = []

    def run(rank):
        try:
            tokenize(
                str(src),
                Placement(tmp_path / "cache", rank=rank, world=2, log=logs[rank].append),
                TextOptions(val_fraction=0.0, workers=1),
                poll_s=0.05,
            )
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [x for x in logs[1] if x.startswith("tokenizing") and "rank 1 of 2: 1 of 2 shards" in x], logs[1]
    replaced = [x for x in logs[0] if "by U+FFFD in 1 records" in x]
    assert replaced and "surrogate.jsonl:2" in replaced[0], logs
    assert not [x for x in logs[1] if "U+FFFD" in x]
