"""Tests of functrain.data: corpus building and caching, sources, splits, errors, stateless batches."""

import json
import os
import pickle
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from functrain.data import (
    SEPARATOR,
    Batching,
    ByteTokenizer,
    ConcatTokens,
    DataError,
    Placement,
    TextOptions,
    eval_batches,
    get_batch,
    load_dataset,
    stdlib_files,
    token_cache,
)
from functrain.data.documents import PACK_BYTES, is_val, text_units


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def stdlib(stdlib_cache):
    return load_dataset("stdlib", Placement(stdlib_cache), block_size=256)


def _text_dir(root, n=40):
    """A directory of n small text files with distinct, recognisable contents."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        sub = root / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:03d}.txt").write_text(f"<file {i:03d}> " + "lorem ipsum dolor " * 20 + f"</{i:03d}>")
    return root


def _cache_files(out):
    """Every file of a token cache directory, relative, with its mtime."""
    return {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in Path(out).rglob("*") if p.is_file()}


def test_stdlib_corpus_builds_and_is_cached(stdlib, stdlib_cache):
    assert stdlib.vocab_size == 256 and isinstance(stdlib.tokenizer, ByteTokenizer)
    assert stdlib.train.dtype == np.uint16 and isinstance(stdlib.train, ConcatTokens)
    assert len(stdlib.train) > 5_000_000 and 0 < len(stdlib.val) < 0.05 * len(stdlib.train)
    out = stdlib.info["cache_dir"]
    before = _cache_files(out)
    assert "meta.json" in before and any(f.startswith("train/") for f in before)
    again = load_dataset("stdlib", Placement(stdlib_cache))
    assert _cache_files(out) == before  # reused, not rewritten
    assert again.info["cache_dir"] == out and np.array_equal(again.val[:], stdlib.val[:])
    meta = json.loads((Path(out) / "meta.json").read_text())
    assert meta["format"] == "functrain-tokens" and meta["kind"] == "text"
    assert meta["tokens"]["train"] == len(stdlib.train) + 1 and meta["tokens"]["val"] == len(stdlib.val) + 1
    assert not [f for f in before if ".tmp-" in f]


def test_stdlib_split_is_by_file(stdlib):
    files = stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    assert not [p for p in files if "site-packages" in p.parts or "__pycache__" in p.parts]
    rels = [p.relative_to(root).as_posix() for p in files]
    assert [c[0] for c in stdlib.info["content"]] == rels
    val_files = stdlib.info["val_files"]
    assert val_files == [r for r in rels if is_val(r, 0.015)] and 1 <= len(val_files) < 0.05 * len(files)
    # the val tokens are exactly the val files, in order, newline-separated
    expected = SEPARATOR.join(open(os.path.join(root, f), "rb").read() for f in val_files)
    assert bytes(np.asarray(stdlib.val[:], dtype=np.uint8)) == expected
    assert stdlib.info["units"] > 1  # packed into a few units, tokenized in parallel


def test_encode_decode_roundtrip(stdlib):
    s = "def f(x):\n    return 'héllo → 世界'\n"
    assert stdlib.decode(stdlib.encode(s)) == s
    assert stdlib.encode(s).dtype == np.int64
    assert stdlib.decode(torch.from_numpy(stdlib.encode(s))) == s
    assert "def " in stdlib.decode(stdlib.train[:200_000])


def test_get_batch_is_pure_in_seed_and_step(stdlib):
    seed0, seed1 = Batching(8, 64, seed=0), Batching(8, 64, seed=1)
    x1, y1 = get_batch(stdlib.train, seed0, 5)
    x2, y2 = get_batch(stdlib.train, seed0, 5)
    x3, _ = get_batch(stdlib.train, seed0, 6)
    x4, _ = get_batch(stdlib.train, seed1, 5)
    assert x1.shape == y1.shape == (8, 64) and x1.dtype == y1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # y is x shifted by one token
    x5, _ = get_batch(stdlib.train, seed0, torch.tensor(5))  # a tensor step works
    assert torch.equal(x1, x5)


def test_get_batch_ranks_partition_the_global_batch(stdlib):
    batching = Batching(8, 32, seed=3)
    x, y = get_batch(stdlib.train, batching, 11)
    parts = [get_batch(stdlib.train, batching, 11, rank=r, world=2) for r in range(2)]
    assert parts[0][0].shape == (4, 32)
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError, match="divisible"):
        get_batch(stdlib.train, batching, 11, rank=0, world=3)
    with pytest.raises(ValueError, match="rank"):
        get_batch(stdlib.train, batching, 11, rank=2, world=2)


def test_eval_batches_are_fixed_and_not_train_batches(stdlib):
    batching = Batching(4, 16, eval_batches=3)
    a, b = list(eval_batches(stdlib.val, batching)), list(eval_batches(stdlib.val, batching))
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])
    train_like = get_batch(stdlib.val, batching, 0)
    assert not torch.equal(a[0][0], train_like[0])
    halves = [list(eval_batches(stdlib.val, batching, rank=r, world=2)) for r in range(2)]
    assert not torch.equal(next(eval_batches(stdlib.val, batching, seed=1))[0], a[0][0])  # the seed fixes the set
    assert torch.equal(torch.cat([halves[0][0][0], halves[1][0][0]]), a[0][0])


def test_text_dir_split_by_file(tmp_path):
    root = _text_dir(tmp_path / "corpus")
    (root / ".hidden.txt").write_text("HIDDEN")
    (root / "blob.dat").write_bytes(b"\0\1\2BINARY")
    ds = load_dataset(str(root), Placement(tmp_path / "cache"), TextOptions(val_fraction=0.1))
    train, val = ds.decode(ds.train), ds.decode(ds.val)
    assert "HIDDEN" not in train + val and "BINARY" not in train + val
    n_val = 0
    for i in range(40):
        whole = f"<file {i:03d}> " + "lorem ipsum dolor " * 20 + f"</{i:03d}>"
        assert (whole in train) != (whole in val)  # every file wholly in exactly one split
        n_val += whole in val
    assert 1 <= n_val < 40 and n_val == len(ds.info["val_files"])
    # deterministic: a second cache dir gives the same split
    ds2 = load_dataset(str(root), Placement(tmp_path / "cache2"), TextOptions(val_fraction=0.1))
    assert np.array_equal(ds2.val, ds.val)


def test_text_cache_retokenizes_the_pack_of_a_changed_file(tmp_path, monkeypatch):
    monkeypatch.setattr("functrain.data.documents.PACK_BYTES", 300)  # several packs of a few files
    root = _text_dir(tmp_path / "corpus", n=12)
    ds1 = load_dataset(str(root), Placement(tmp_path / "cache", log=lambda line: None))
    out = ds1.info["cache_dir"]
    assert ds1.info["units"] > 2
    before = _cache_files(out)
    (root / "d0" / "f000.txt").write_text("CHANGED " * 10)  # the first file: its pack only
    ds2 = load_dataset(str(root), Placement(tmp_path / "cache", log=lambda line: None))
    assert ds2.info["cache_dir"] == out
    assert "CHANGED" in ds2.decode(ds2.train[:]) + ds2.decode(ds2.val[:])
    after = _cache_files(out)
    changed = {f for f in before if before[f] != after.get(f)}
    assert changed and {f[len("done/") : -len(".json")] for f in changed if f.startswith("done/")} == {
        next(u["key"] for u in text_units(ds2.info["content"], 0.015) if u["rel"] == "d0/f000.txt")
    }
    fresh = load_dataset(str(root), Placement(tmp_path / "fresh", log=lambda line: None))
    assert np.array_equal(fresh.train[:], ds2.train[:]) and np.array_equal(fresh.val[:], ds2.val[:])


def test_packs_end_where_the_path_hash_says():
    content = [[f"f{i:04d}.txt", 1 << 20, None] for i in range(200)]
    units = text_units(content, 0.015)
    assert [f for u in units for f in u["files"]] == content and 4 < len(units) < 40  # ~16 files per pack
    grown = text_units(content[:100] + [["f0100a.txt", 10, None]] + content[100:], 0.015)
    assert sum(u not in units for u in grown) == 1  # adding a file changes its own pack only
    assert PACK_BYTES == 16 << 20


def test_single_text_file_split_by_position(tmp_path):
    text = "".join(f"line {i}\n" for i in range(2000))
    path = tmp_path / "input.txt"
    path.write_text(text)
    ds = load_dataset(str(path), Placement(tmp_path / "cache"), TextOptions(val_fraction=0.01), block_size=8)
    assert ds.decode(ds.train) + ds.decode(ds.val) == text
    assert len(ds.val) == int(len(text) * 0.01)


def test_bin_source_with_meta(tmp_path):
    rng = np.random.default_rng(0)
    np.array(rng.integers(0, 65, 5000), dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.array(rng.integers(0, 65, 500), dtype=np.uint16).tofile(tmp_path / "val.bin")
    chars = [chr(ord("A") + i) for i in range(65)]
    with open(tmp_path / "meta.pkl", "wb") as f:  # nanoGPT shakespeare_char style
        pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}, f)
    ds = load_dataset(str(tmp_path), Placement(tmp_path / "unused"))
    assert ds.vocab_size == 65 and len(ds.train) == 5000 and isinstance(ds.train, np.memmap)
    assert ds.decode(ds.encode("HELLO")) == "HELLO"
    x, y = get_batch(ds.train, Batching(4, 16), 0)
    assert int(x.max()) < 65
    assert load_dataset(str(tmp_path / "train.bin"), Placement(tmp_path / "unused")).vocab_size == 65


def test_bin_source_vocab_from_config_or_error(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(DataError, match="vocab_size"):
        load_dataset(str(tmp_path), Placement(tmp_path / "c"))
    ds = load_dataset(str(tmp_path), Placement(tmp_path / "c"), vocab_size=50304)
    assert ds.vocab_size == 50304 and ds.decode([15496, 995]) == "15496 995"
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 1000}))
    assert load_dataset(str(tmp_path), Placement(tmp_path / "c")).vocab_size == 1000


def test_cache_dir_is_itself_a_bin_source(stdlib):
    ds = load_dataset(stdlib.info["cache_dir"], Placement("/nonexistent-unused"))
    assert ds.vocab_size == 256 and isinstance(ds.tokenizer, ByteTokenizer)
    assert len(ds.train) == len(stdlib.train) and np.array_equal(ds.val[:], stdlib.val[:])


def test_missing_path_is_one_clear_line():
    with pytest.raises(DataError) as e:
        load_dataset("/nope/nothing-here", Placement("/tmp/unused"))
    msg = str(e.value)
    assert "'/nope/nothing-here' does not exist" in msg and "train.bin" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)


def test_empty_and_too_short_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text"):
        load_dataset(str(tmp_path / "empty"), Placement(tmp_path / "c"))
    short = tmp_path / "short.txt"
    short.write_text("x" * 300)
    with pytest.raises(DataError, match=r"val split has \d+ tokens, fewer than block_size \+ 1 = 65"):
        load_dataset(str(short), Placement(tmp_path / "c"), block_size=64)
    with pytest.raises(DataError, match="block_size"):
        get_batch(np.zeros(10, np.uint16), Batching(2, 10), 0)


def test_killed_build_leaves_no_complete_looking_cache(tmp_path, monkeypatch):
    root = _text_dir(tmp_path / "corpus", n=4)
    real = token_cache.read_unit

    def killed(*args, **kwargs):
        yield next(real(*args, **kwargs))
        raise KeyboardInterrupt  # the run is killed while tokenizing

    monkeypatch.setattr(token_cache, "read_unit", killed)
    with pytest.raises(KeyboardInterrupt):
        load_dataset(str(root), Placement(tmp_path / "cache", log=lambda line: None))
    (out,) = [p for p in (tmp_path / "cache").iterdir() if p.name != "digests"]  # (digests: the files' sha256 memo)
    assert not [f for f in _cache_files(out)]  # no meta.json, no marker, no half token file
    monkeypatch.undo()
    ds = load_dataset(str(root), Placement(tmp_path / "cache", log=lambda line: None))  # the next run rebuilds
    assert "meta.json" in _cache_files(out) and len(ds.val) > 0


def test_one_document_per_split_at_least(tmp_path):
    root = tmp_path / "two"
    root.mkdir()
    (root / "a.txt").write_text("first file " * 30)
    (root / "b.txt").write_text("second file " * 30)
    for fraction in (1e-9, 1.0):  # no file draws into val / every file does: the first moves across
        ds = load_dataset(
            str(root), Placement(tmp_path / "c", log=lambda line: None), TextOptions(val_fraction=fraction)
        )
        assert ds.info["val_files"] == (["a.txt"] if fraction < 0.5 else ["b.txt"])
        assert len(ds.train) and len(ds.val)


def test_bpe_is_deterministic_round_trips_and_keeps_val_unseen(tmp_path):
    from functrain.data import END_OF_TEXT, HFTokenizer, train_bpe, train_tokenizer

    root = _text_dir(tmp_path / "corpus", n=6)
    a = train_tokenizer(str(root), tmp_path / "c1", 300, val_fraction=0.3)
    b = train_tokenizer(str(root), tmp_path / "c2", 300, val_fraction=0.3)
    assert a.path.read_bytes() == b.path.read_bytes() and a.path.parent == tmp_path / "c1"  # same text, same file
    assert train_tokenizer(str(root), tmp_path / "c1", 300, val_fraction=0.3).path == a.path  # reused
    text = "déjà vu: ∑ x_i\n\tdef f():  return 1\n"
    assert a.decode(a.encode(text)) == text  # byte-level: any text round-trips
    assert a.eos_id == 0 and a.decode([a.eos_id]) == END_OF_TEXT
    ds = load_dataset(str(root), Placement(tmp_path / "c1"), TextOptions(val_fraction=0.3), tokenizer=a)
    assert (
        ds.train.dtype == np.uint16
        and ds.vocab_size == a.vocab_size
        and ds.info["tokenizer"] == f"tokenizers:{a.sha256}"
    )
    assert ds.decode(ds.train[:50]) == a.decode(a.encode(ds.decode(ds.train[:50])))
    # the BPE saw only the train split: training on those files alone gives the same merges
    train_files = [p for p in sorted(root.rglob("*.txt")) if p.relative_to(root).as_posix() not in ds.info["val_files"]]
    alone = train_bpe([p.read_text() for p in train_files], 300, tmp_path / "alone.json")
    assert alone.path.read_text() == a.path.read_text()
    again = load_dataset(
        str(root), Placement(tmp_path / "c1"), TextOptions(val_fraction=0.3), tokenizer=HFTokenizer(a.path)
    )
    assert again.info["cache_dir"] == ds.info["cache_dir"] and np.array_equal(again.train, ds.train)
    assert (
        load_dataset(str(root), Placement(tmp_path / "c1"), TextOptions(val_fraction=0.3)).info["cache_dir"]
        != ds.info["cache_dir"]
    )


def test_large_vocabularies_are_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from functrain.data import HFTokenizer

    words = {f"w{i}": i for i in range(70_000)}
    words["[UNK]"] = 70_000
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"w{(i * 7919) % 70_000}" for i in range(3000)))
    ds = load_dataset(
        str(text), Placement(tmp_path / "cache"), TextOptions(val_fraction=0.1), tokenizer=HFTokenizer(tmp_path)
    )
    assert ds.train.dtype == np.uint32 and ds.vocab_size == 70_001
    assert int(np.max(ds.train)) > 65_535  # ids above uint16 survive
    assert ds.train[:3].tolist() == [0, 7919, 15838]
    x, y = get_batch(ds.train, Batching(4, 8), 3)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def test_bad_tokenizer_file_is_one_line(tmp_path):
    from functrain.data import HFTokenizer

    with pytest.raises(DataError, match="nothing.json: no such tokenizer file"):
        HFTokenizer(tmp_path / "nothing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="bad.json: not a tokenizers file"):
        HFTokenizer(tmp_path / "bad.json")


def test_a_script_that_loads_data_at_import_time_needs_no_main_guard(tmp_path):
    """Small sources tokenize in the calling process by default: no spawned worker re-imports the script."""
    import subprocess
    import sys

    root = _text_dir(tmp_path / "corpus", n=6)
    script = tmp_path / "script.py"
    script.write_text(
        "from functrain.data import Placement, load_dataset\n"
        f"ds = load_dataset({str(root)!r}, Placement({str(tmp_path / 'cache')!r}, log=lambda line: None))\n"
        "print(len(ds.train) > 0)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(script)],
        env=dict(os.environ, PYTHONPATH=str(repo)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
