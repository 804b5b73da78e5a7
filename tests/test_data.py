"""Tests of functrain.data: corpus building and caching, sources, splits, errors, stateless batches."""

import json
import os
import pickle

import numpy as np
import pytest
import torch

from functrain.data import (
    SEPARATOR,
    ByteTokenizer,
    DataError,
    eval_batches,
    get_batch,
    load_dataset,
    stdlib_files,
)
from functrain.data import corpus


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def stdlib(stdlib_cache):
    return load_dataset("stdlib", stdlib_cache, block_size=256)


def _text_dir(root, n=40):
    """A directory of n small text files with distinct, recognisable contents."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        sub = root / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:03d}.txt").write_text(f"<file {i:03d}> " + "lorem ipsum dolor " * 20 + f"</{i:03d}>")
    return root


def test_stdlib_corpus_builds_and_is_cached(stdlib, stdlib_cache):
    assert stdlib.vocab_size == 256 and isinstance(stdlib.tokenizer, ByteTokenizer)
    assert stdlib.train.dtype == np.uint16 and isinstance(stdlib.train, np.memmap)
    assert len(stdlib.train) > 5_000_000 and 0 < len(stdlib.val) < 0.05 * len(stdlib.train)
    out = stdlib.info["cache_dir"]
    files = [os.path.join(out, f) for f in ("train.bin", "val.bin", "meta.json")]
    mtimes = [os.stat(f).st_mtime_ns for f in files]
    again = load_dataset("stdlib", stdlib_cache)
    assert [os.stat(f).st_mtime_ns for f in files] == mtimes  # reused, not rewritten
    assert again.info["cache_dir"] == out and np.array_equal(again.val, stdlib.val)
    meta = json.loads(open(files[2]).read())
    assert meta["tokens"] == {"train": len(stdlib.train), "val": len(stdlib.val)}
    assert not [f for f in os.listdir(out) if ".tmp-" in f]


def test_stdlib_split_is_by_file(stdlib):
    files = stdlib_files()
    assert not [p for p in files if "site-packages" in p.parts or "__pycache__" in p.parts]
    n_train, n_val = stdlib.info["files"]["train"], stdlib.info["files"]["val"]
    assert n_train + n_val == len(files) and 1 <= n_val < 0.05 * len(files)
    val_files = stdlib.info["val_files"]
    assert len(val_files) == n_val
    # the val tokens are exactly the val files, in order, newline-separated
    root = stdlib.info["root"]
    expected = SEPARATOR.join(open(os.path.join(root, f), "rb").read() for f in val_files)
    assert bytes(np.asarray(stdlib.val, dtype=np.uint8)) == expected


def test_encode_decode_roundtrip(stdlib):
    s = "def f(x):\n    return 'héllo → 世界'\n"
    assert stdlib.decode(stdlib.encode(s)) == s
    assert stdlib.encode(s).dtype == np.int64
    assert stdlib.decode(torch.from_numpy(stdlib.encode(s))) == s
    assert "def " in stdlib.decode(stdlib.train[:200_000])


def test_get_batch_is_pure_in_seed_and_step(stdlib):
    kw = dict(batch_size=8, block_size=64)
    x1, y1 = get_batch(stdlib.train, seed=0, step=5, **kw)
    x2, y2 = get_batch(stdlib.train, seed=0, step=5, **kw)
    x3, _ = get_batch(stdlib.train, seed=0, step=6, **kw)
    x4, _ = get_batch(stdlib.train, seed=1, step=5, **kw)
    assert x1.shape == y1.shape == (8, 64) and x1.dtype == y1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # y is x shifted by one token
    x5, _ = get_batch(stdlib.train, seed=0, step=torch.tensor(5), **kw)  # a tensor step works
    assert torch.equal(x1, x5)


def test_get_batch_ranks_partition_the_global_batch(stdlib):
    kw = dict(batch_size=8, block_size=32, seed=3, step=11)
    x, y = get_batch(stdlib.train, **kw)
    parts = [get_batch(stdlib.train, rank=r, world=2, **kw) for r in range(2)]
    assert parts[0][0].shape == (4, 32)
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError, match="divisible"):
        get_batch(stdlib.train, rank=0, world=3, **kw)
    with pytest.raises(ValueError, match="rank"):
        get_batch(stdlib.train, rank=2, world=2, **kw)


def test_eval_batches_are_fixed_and_not_train_batches(stdlib):
    kw = dict(batch_size=4, block_size=16, num_batches=3)
    a, b = list(eval_batches(stdlib.val, **kw)), list(eval_batches(stdlib.val, **kw))
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])
    train_like = get_batch(stdlib.val, batch_size=4, block_size=16, seed=0, step=0)
    assert not torch.equal(a[0][0], train_like[0])
    halves = [list(eval_batches(stdlib.val, rank=r, world=2, **kw)) for r in range(2)]
    assert torch.equal(torch.cat([halves[0][0][0], halves[1][0][0]]), a[0][0])


def test_text_dir_split_by_file(tmp_path):
    root = _text_dir(tmp_path / "corpus")
    (root / ".hidden.txt").write_text("HIDDEN")
    (root / "blob.dat").write_bytes(b"\0\1\2BINARY")
    ds = load_dataset(str(root), tmp_path / "cache", val_fraction=0.1)
    train, val = ds.decode(ds.train), ds.decode(ds.val)
    assert "HIDDEN" not in train + val and "BINARY" not in train + val
    n_val = 0
    for i in range(40):
        whole = f"<file {i:03d}> " + "lorem ipsum dolor " * 20 + f"</{i:03d}>"
        assert (whole in train) != (whole in val)  # every file wholly in exactly one split
        n_val += whole in val
    assert 1 <= n_val < 40 and n_val == ds.info["files"]["val"]
    # deterministic: a second cache dir gives the same split
    ds2 = load_dataset(str(root), tmp_path / "cache2", val_fraction=0.1)
    assert np.array_equal(ds2.val, ds.val)


def test_text_cache_rebuilt_when_a_file_changes(tmp_path):
    root = _text_dir(tmp_path / "corpus", n=5)
    ds1 = load_dataset(str(root), tmp_path / "cache")
    (root / "d0" / "f000.txt").write_text("CHANGED " * 10)
    ds2 = load_dataset(str(root), tmp_path / "cache")
    assert ds2.info["cache_dir"] != ds1.info["cache_dir"]
    assert "CHANGED" in ds2.decode(ds2.train) + ds2.decode(ds2.val)


def test_single_text_file_split_by_position(tmp_path):
    text = "".join(f"line {i}\n" for i in range(2000))
    path = tmp_path / "input.txt"
    path.write_text(text)
    ds = load_dataset(str(path), tmp_path / "cache", val_fraction=0.01, block_size=8)
    assert ds.decode(ds.train) + ds.decode(ds.val) == text
    assert len(ds.val) == int(len(text) * 0.01)


def test_bin_source_with_meta(tmp_path):
    rng = np.random.default_rng(0)
    np.array(rng.integers(0, 65, 5000), dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.array(rng.integers(0, 65, 500), dtype=np.uint16).tofile(tmp_path / "val.bin")
    chars = [chr(ord("A") + i) for i in range(65)]
    with open(tmp_path / "meta.pkl", "wb") as f:  # nanoGPT shakespeare_char style
        pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    ds = load_dataset(str(tmp_path), tmp_path / "unused")
    assert ds.vocab_size == 65 and len(ds.train) == 5000 and isinstance(ds.train, np.memmap)
    assert ds.decode(ds.encode("HELLO")) == "HELLO"
    x, y = get_batch(ds.train, batch_size=4, block_size=16, seed=0, step=0)
    assert int(x.max()) < 65
    assert load_dataset(str(tmp_path / "train.bin"), tmp_path / "unused").vocab_size == 65


def test_bin_source_vocab_from_config_or_error(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(DataError, match="vocab_size"):
        load_dataset(str(tmp_path), tmp_path / "c")
    ds = load_dataset(str(tmp_path), tmp_path / "c", vocab_size=50304)
    assert ds.vocab_size == 50304 and ds.decode([15496, 995]) == "15496 995"
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 1000}))
    assert load_dataset(str(tmp_path), tmp_path / "c").vocab_size == 1000


def test_cache_dir_is_itself_a_bin_source(stdlib):
    ds = load_dataset(stdlib.info["cache_dir"], "/nonexistent-unused")
    assert ds.vocab_size == 256 and isinstance(ds.tokenizer, ByteTokenizer)
    assert len(ds.train) == len(stdlib.train)


def test_missing_path_is_one_clear_line():
    with pytest.raises(DataError) as e:
        load_dataset("/nope/nothing-here", "/tmp/unused")
    msg = str(e.value)
    assert "'/nope/nothing-here' does not exist" in msg and "train.bin" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)


def test_empty_and_too_short_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text"):
        load_dataset(str(tmp_path / "empty"), tmp_path / "c")
    short = tmp_path / "short.txt"
    short.write_text("x" * 300)
    with pytest.raises(DataError, match=r"val split has \d+ tokens, fewer than block_size \+ 1 = 65"):
        load_dataset(str(short), tmp_path / "c", block_size=64)
    with pytest.raises(DataError, match="block_size"):
        get_batch(np.zeros(10, np.uint16), batch_size=2, block_size=10, seed=0, step=0)


def test_killed_build_leaves_no_complete_looking_cache(tmp_path, monkeypatch):
    root = _text_dir(tmp_path / "corpus", n=4)

    def die(*args, **kwargs):
        raise KeyboardInterrupt  # the run is killed while writing val.bin

    real = corpus._write_tokens
    monkeypatch.setattr(corpus, "_write_tokens", lambda dst, pieces, *a: (
        real(dst, pieces, *a) if dst.name == "train.bin" else die()))
    with pytest.raises(KeyboardInterrupt):
        load_dataset(str(root), tmp_path / "cache")
    (out,) = [p for p in (tmp_path / "cache").iterdir() if p.name != "digests"]  # (digests: the files' sha256 memo)
    assert sorted(os.listdir(out)) == ["train.bin"]  # no meta.json, no half val.bin
    monkeypatch.undo()
    ds = load_dataset(str(root), tmp_path / "cache")  # the next run rebuilds
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
    assert len(ds.val) > 0


def test_failed_write_leaves_no_file(tmp_path):
    dst = tmp_path / "train.bin"
    with pytest.raises(OSError):
        corpus._write_tokens(dst, [(tmp_path / "missing.txt", 0, 10)], corpus.ByteTokenizer(), corpus.np.uint16)
    assert os.listdir(tmp_path) == []


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
    ds = load_dataset(str(root), tmp_path / "c1", val_fraction=0.3, tokenizer=a)
    assert ds.train.dtype == np.uint16 and ds.vocab_size == a.vocab_size and ds.info["tokenizer_sha256"] == a.sha256
    assert ds.decode(ds.train[:50]) == a.decode(a.encode(ds.decode(ds.train[:50])))
    # the BPE saw only the train split: training on those files alone gives the same merges
    train_files = [p for p in sorted(root.rglob("*.txt")) if p.relative_to(root).as_posix() not in ds.info["val_files"]]
    alone = train_bpe([p.read_text() for p in train_files], 300, tmp_path / "alone.json")
    assert alone.path.read_text() == a.path.read_text()
    again = load_dataset(str(root), tmp_path / "c1", val_fraction=0.3, tokenizer=HFTokenizer(a.path))
    assert again.info["cache_dir"] == ds.info["cache_dir"] and np.array_equal(again.train, ds.train)
    assert load_dataset(str(root), tmp_path / "c1", val_fraction=0.3).info["cache_dir"] != ds.info["cache_dir"]


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
    ds = load_dataset(str(text), tmp_path / "cache", val_fraction=0.1, tokenizer=HFTokenizer(tmp_path))
    assert ds.train.dtype == np.uint32 and ds.vocab_size == 70_001
    assert int(ds.train.max()) > 65_535  # ids above uint16 survive
    assert ds.train[:3].tolist() == [0, 7919, 15838]
    x, y = get_batch(ds.train, batch_size=4, block_size=8, seed=0, step=3)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def test_bad_tokenizer_file_is_one_line(tmp_path):
    from functrain.data import HFTokenizer

    with pytest.raises(DataError, match="nothing.json: no such tokenizer file"):
        HFTokenizer(tmp_path / "nothing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="bad.json: not a tokenizers file"):
        HFTokenizer(tmp_path / "bad.json")
