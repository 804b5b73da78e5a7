"""Benchmark: the data path. Tokenization throughput on 1 vs 2 worker processes and its memory, the
time to make a batch next to the step time, and the loader time the training loop still sees.

    python bench/data.py [--mb 200] [--shards 8] [--bpe 0] [--loop-steps 100] [--gpt2-rows 1] [--json]

tokenize: a jsonl corpus of `--mb` MB in `--shards` shards (written to a temporary directory) is
tokenized from scratch with 1 worker and with 2 (`functrain.data.tokenize`, bytes, or a
byte-level BPE of `--bpe` ids trained on the corpus first); printed: MB/s of each and their ratio
(target >= 1.8 on 2 cores). memory: a fresh process tokenizes the same corpus on one worker; printed:
its peak RSS growth over its RSS before tokenizing, and the corpus size as a multiple of it (memory
is flat in corpus size: bounded groups of text are streamed).

batches: the time `Sampler.batch` takes for the default job's batch (32 x 128 windows of the stdlib
corpus) and the `gpt2` variant's (480 x 1024 windows of a 100M-token memmap; windows and epochs),
next to the step time at that shape: the default step measured by the loop below, the gpt2 step
measured eagerly on `--gpt2-rows` rows of 1024 tokens and scaled to 480 rows (a CPU stands in for
the GPU it is meant for: the ratio is the CPU's).

loop: the default job for `--loop-steps` steps (compiled, prefetch on); printed: the loop's wait
for batches per step (`data_wait_ms` of metrics.jsonl, steady state: the log rows after the first)
as a share of the step time (target <= 2%).

With `--json` the last line is one JSON object.

Measured: docs/results.md ("bench/data.py").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from functrain.data import Placement, Sampler, load_dataset, train_bpe  # noqa: E402

_WORDS = (
    "def return class import self if else for while in not and or None True False raise "
    "the of and to in is was for on that with by as at from"
).split()


def _corpus(root: Path, mb: int, shards: int) -> int:
    """Writes ~mb MB of jsonl in `shards` files; returns its bytes."""
    rnd = random.Random(0)
    lines = [
        json.dumps({"text": " ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(20, 400)))}) + "\n"
        for _ in range(2000)
    ]
    block = "".join(lines).encode()
    per = mb * 1_000_000 // shards
    for i in range(shards):
        with open(root / f"part{i:03d}.jsonl", "wb") as f:
            for _ in range(max(1, per // len(block))):
                f.write(block)
    return sum(p.stat().st_size for p in root.glob("*.jsonl"))


_TIMED = """
import sys, time
from functrain.data import HFTokenizer, Placement, TextOptions, tokenize
tok = HFTokenizer(sys.argv[4]) if sys.argv[4] else None
t0 = time.perf_counter()
place = Placement(sys.argv[2], log=lambda line: None)
tokenize(sys.argv[1], place, TextOptions(workers=int(sys.argv[3])), tokenizer=tok)
print(time.perf_counter() - t0)
"""


def _tokenize(src: Path, cache: Path, workers: int, tokenizer_file: str) -> float:
    """Seconds a fresh process takes to tokenize src from scratch with `workers` single-threaded workers
    (TOKENIZERS_PARALLELISM=false: one worker is one core, as the library's worker processes run)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _TIMED, str(src), str(cache), str(workers), tokenizer_file],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return float(out.stdout.split()[-1])


_MEMORY_PROBE = """
import sys
from functrain.data import Placement, TextOptions, tokenize
import pathlib
rss_now = int(pathlib.Path('/proc/self/statm').read_text().split()[1]) * 4096 // 1024
tokenize(sys.argv[1], Placement(sys.argv[2], log=lambda line: None), TextOptions(workers=1))
hwm = [l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM:')]
print(rss_now, int(hwm[0].split()[1]))  # VmHWM: this program's peak (ru_maxrss would keep the forking parent's)
"""


def _memory(src: Path, cache: Path) -> tuple[float, float]:
    """(RSS before tokenizing, peak RSS) of a fresh process tokenizing src on one worker, in MB."""
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(src), str(cache)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        check=True,
    )
    before, peak = map(int, out.stdout.split())
    return before / 1024, peak / 1024


def _batch_ms(sampler: Sampler, rounds: int = 20) -> float:
    """Median ms of one global batch."""
    times = []
    for step in range(rounds):
        t0 = time.perf_counter()
        sampler.batch(step)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _gpt2_step_ms(rows: int) -> float:
    """The gpt2 variant's eager forward + backward on `rows` x 1024 tokens, in ms, scaled to 480 rows."""
    import torch

    from functrain.models.gpt import model as gpt

    cfg = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=False)
    model = gpt.GPT(cfg)
    x = torch.randint(0, 50304, (rows, 1024))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times) * 480 / rows


def _loop(steps: int, workdir: Path) -> tuple[float, float]:
    """(median data_wait_ms, median step ms) of the default job's steady-state log rows."""
    cmd = [
        sys.executable,
        "-m",
        "functrain.main",
        "--config=configs/gpt.py",
        f"--workdir={workdir}",
        f"--config.steps={steps}",
        "--config.log_every=10",
        f"--config.eval_every={steps}",
        "--config.sample.max_new_tokens=0",
        "--config.checkpoint.every=0",
    ]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    rows = [r for r in rows if "data_wait_ms" in r][1:]
    return statistics.median(r["data_wait_ms"] for r in rows), 1e3 * statistics.median(r["step_time_s"] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--bpe", type=int, default=0, help="tokenize with a byte-level BPE of this many ids (0: bytes)")
    ap.add_argument("--loop-steps", type=int, default=100, help="0: skip the loop")
    ap.add_argument("--gpt2-rows", type=int, default=1, help="0: skip the gpt2 step")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict = {"cpus": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "src").mkdir()
        size = _corpus(tmp / "src", args.mb, args.shards)
        tokenizer_file = ""
        if args.bpe:
            from functrain.data.documents import train_documents

            docs = train_documents(str(tmp / "src"))
            train_bpe((d for d, _ in zip(docs, range(20000))), args.bpe, tmp / "bpe.json")
            tokenizer_file = str(tmp / "bpe.json")
        one = _tokenize(tmp / "src", tmp / "c1", 1, tokenizer_file)
        two = _tokenize(tmp / "src", tmp / "c2", 2, tokenizer_file)
        result.update(
            corpus_mb=size / 1e6,
            tokenizer=f"bpe{args.bpe}" if args.bpe else "bytes",
            tokenize_mb_s_1=size / 1e6 / one,
            tokenize_mb_s_2=size / 1e6 / two,
            tokenize_speedup=one / two,
        )
        print(
            f"tokenize {size / 1e6:.0f} MB ({result['tokenizer']}): 1 worker {size / 1e6 / one:.1f} MB/s, "
            f"2 workers {size / 1e6 / two:.1f} MB/s: {one / two:.2f}x"
        )
        before, peak = _memory(tmp / "src", tmp / "c3")
        result.update(rss_before_mb=before, rss_peak_mb=peak, corpus_over_growth=size / 1e6 / max(peak - before, 1e-9))
        print(
            f"memory: RSS {before:.0f} MB before tokenizing, peak {peak:.0f} MB: +{peak - before:.0f} MB for a "
            f"{size / 1e6:.0f} MB corpus ({result['corpus_over_growth']:.0f}x the growth)"
        )
        stdlib = load_dataset("stdlib", Placement(tmp / "stdlib"))
        default = Sampler([("stdlib", stdlib.train, 1.0)], batch_size=32, block_size=128, seed=0)
        result["batch_ms_default"] = _batch_ms(default)
        big = np.memmap(tmp / "big.bin", dtype=np.uint16, mode="w+", shape=(100_000_000,))
        big[::4096] = 1
        big.flush()
        for sampling in ("windows", "epochs"):
            s = Sampler(
                [("owt", np.memmap(tmp / "big.bin", dtype=np.uint16, mode="r"), 1.0)],
                batch_size=480,
                block_size=1024,
                seed=0,
                sampling=sampling,
            )
            result[f"batch_ms_gpt2_{sampling}"] = _batch_ms(s, 5)
        line = (
            f"batch: default (32 x 128) {result['batch_ms_default']:.2f} ms; gpt2 (480 x 1024) windows "
            f"{result['batch_ms_gpt2_windows']:.1f} ms, epochs {result['batch_ms_gpt2_epochs']:.1f} ms"
        )
        if args.gpt2_rows:
            result["step_ms_gpt2_cpu_scaled"] = _gpt2_step_ms(args.gpt2_rows)
            line += (
                f"; gpt2 step (CPU, scaled from {args.gpt2_rows} rows) {result['step_ms_gpt2_cpu_scaled']:.0f} ms: "
                f"batch {100 * result['batch_ms_gpt2_epochs'] / result['step_ms_gpt2_cpu_scaled']:.3f}% of it"
            )
        print(line)
        if args.loop_steps:
            wait, step = _loop(args.loop_steps, tmp / "run")
            result.update(
                loop_data_wait_ms=wait,
                loop_step_ms=step,
                loop_visible_share=wait / step,
                batch_share_default=result["batch_ms_default"] / step,
            )
            print(
                f"loop (default job, {args.loop_steps} steps): step {step:.1f} ms, a batch takes "
                f"{result['batch_ms_default']:.2f} ms ({100 * result['batch_ms_default'] / step:.1f}%), the loop waits "
                f"{wait:.3f} ms for it ({100 * wait / step:.2f}% of the step)"
            )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
