"""The one table of bench/gpu.sh: tokens/s, MFU (of the published bf16 peak and of the measured
matmul), peak memory and compiled vs eager, for the GPT default and gpt2 shapes (bench/step.py's
`--json` line) and the Llama ~1B shape (two main-job runs, compiled and eager).

    python bench/gpu_table.py STEP_LOG LLAMA_WORKDIR LLAMA_EAGER_WORKDIR

STEP_LOG: bench/step.py's output (its last line is the JSON object). The workdirs: runs of
`functrain.main --config=configs/llama.py:1b` (their metrics.jsonl; the steady-state rows are the
ones after the first log step). A missing input leaves its rows out and says so.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _step_rows(path: Path) -> tuple[list[list[str]], dict]:
    """Rows for bench/step.py's sizes, and its JSON (for the measured matmul)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")]
    if not lines:
        raise ValueError("no JSON line")
    res = json.loads(lines[-1])
    rows = []
    for size, sp in res["sizes"].items():
        mem = sp.get("memory") or {}
        pub = sp.get("mfu_published") or {}
        for name in sp["tokens_per_s"]:
            if name == "torch":
                continue
            ratio = {
                "functrain": sp["ratio"],
                "functrain_graphs": sp.get("graphs_ratio"),
                "functrain_eager": 1 / sp["eager_time_ratio"] if "eager_time_ratio" in sp else None,
            }[name]
            peak = (mem.get(name) or {}).get("peak_mb")  # (measured for the compiled step and torch)
            rows.append(
                [
                    f"GPT {size}",
                    name,
                    f"{sp['tokens_per_s'][name]:,.0f}",
                    f"{pub[name]:.1%}" if name in pub else "-",
                    f"{sp['mfu_matmul'][name]:.1%}",
                    f"{peak:.0f} MB" if peak else "-",
                    f"{ratio:.2f}x" if ratio else "-",
                ]
            )
        rows.append(
            [
                f"GPT {size}",
                "torch eager loop",
                f"{sp['tokens_per_s']['torch']:,.0f}",
                f"{pub['torch']:.1%}" if "torch" in pub else "-",
                f"{sp['mfu_matmul']['torch']:.1%}",
                f"{(mem.get('torch') or {}).get('peak_mb', 0):.0f} MB" if mem else "-",
                "1.00x",
            ]
        )
    return rows, res


def _run_summary(workdir: Path) -> dict:
    """Median tokens/s, MFU and the last peak memory of a main-job run's steady-state log rows."""
    rows = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    if not rows:
        raise ValueError("no throughput rows")
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "mfu": statistics.median(r["mfu"] for r in rows) if "mfu" in rows[0] else None,
        "peak_mb": rows[-1].get("peak_mem_mb"),
    }


def main(argv: list[str]) -> None:
    step_log, llama, llama_eager = (Path(a) for a in argv[1:4])
    rows, res = [], {}
    try:
        rows, res = _step_rows(step_log)
    except (OSError, ValueError, KeyError) as exc:
        print(f"(GPT rows left out: {step_log}: {exc})")
    runs = {}
    for name, wd in (("compiled", llama), ("eager", llama_eager)):
        try:
            runs[name] = _run_summary(wd)
        except (OSError, ValueError, KeyError) as exc:
            print(f"(Llama 1b {name} left out: {wd}: {exc})")
    matmul, published = res.get("matmul_flops"), res.get("published_flops")
    for name, r in runs.items():
        # the loop's MFU is of the published peak where the device is known (else of a measured matmul)
        mfu_mm = r["mfu"] * published / matmul if r["mfu"] and published and matmul else None
        ratio = r["tokens_per_s"] / runs["eager"]["tokens_per_s"] if "eager" in runs else None
        rows.append(
            [
                "Llama 1b",
                f"functrain {name} (main job)",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
                f"{mfu_mm:.1%}" if mfu_mm else "-",
                f"{r['peak_mb']:.0f} MB" if r["peak_mb"] else "-",
                f"{ratio:.2f}x" if ratio else "-",
            ]
        )
    print(
        f"\ntorch {res.get('torch', '?')}, {res.get('device', '?')}, precision {res.get('precision', 'bf16')}; "
        f"measured matmul {matmul / 1e12:.0f} TFLOP/s, published {published / 1e12:.0f} TFLOP/s"
        if matmul and published
        else ""
    )
    print(
        "| shape | step | tokens/s | MFU (published) | MFU (measured matmul) | peak memory | "
        "speed vs eager (GPT: the torch loop; Llama: functrain eager) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main(sys.argv)
