"""Pipeline parallelism: the measured bubble against the schedule's, and per-rank peak memory, GPipe vs 1F1B
(and eager 1F1B).

One launch of N ranks (a pipeline of N stages) trains a GPT whose blocks are cut over the ranks
(`functrain.parallel.pipeline.place`), with M microbatches per step, under each schedule in turn.
Per rank the bench reads the step's profiler ranges (`torch.profiler`; the pipeline names each
action "pipeline F<micro>" / "pipeline B<micro>", each blocking receive "pipeline recv" and the
whole schedule "pipeline schedule"): the seconds each forward and backward computed are its range
less the receives within it. A step's span runs from the first action to the last action of any
rank (the optimizer update left out); a rank's bubble is 1 - (its compute seconds) / (the spans),
over the timed steps. Printed: the mean over ranks, the median step's, the theoretical
(N - 1) / (M + N - 1) of equal stages, and what the schedule leaves idle when transfers are free
(`parallel.pipeline_schedule.simulate`) for two readings of the measured compute: each rank's mean forward
and backward ("for these stages' costs": unequal stages idle more), and each microbatch's own
forward and backward in each step ("for these microbatches' costs": a slow action on the critical
path idles the other ranks more, and a fast one does not give it back). What the measurement adds
to the latter is the pipeline's own share of the bubble: transfers, waiting for them, and the
Python between actions.

The formula assumes equal stages, so the default model gives each rank 8 blocks: the embedding and
the head (with the loss), which the first and the last rank run besides, then weigh ~1% of a stage
(with 4 blocks per rank the last stage computed ~4% more than the first). On CPU each rank is pinned
to a core of its own when there are enough (`--no-pin` leaves them free), and malloc keeps freed
memory for the next step (`--give-back`: glibc's default, which page-faults GPipe's growing
activations in again every step). Memory is the growth of the resident set during one step over
the resident set before it (bench/_mem.py: the kernel's high-water mark, free heap handed back
first; on CUDA `torch.cuda.max_memory_allocated`), per rank, for each schedule; the activations held
are the most tensor memory the actions have allocated and not yet freed at the end of a forward (the
profiler's memory accounting of the action ranges, one profiled step): 1F1B holds at most N - rank
microbatches' activations, GPipe all M. The model is narrow and the microbatches long, so
activations dominate a step's memory.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/pipeline.py --steps 10 --json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 bench/pipeline.py --steps 2 --json

Printed: per schedule the step time, the bubble (measured and theoretical, per rank) and each rank's
peak; the 1F1B / GPipe peak ratio per rank against N / M; with --json a last line of JSON.
Measured: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mem import keep_freed, reset_peak, status_mib, trim  # noqa: E402

from functrain import init_state, optim, rng  # noqa: E402
from functrain.models import gpt  # noqa: E402
from functrain.parallel import pipeline  # noqa: E402
from functrain.parallel import pipeline_schedule as schedules  # noqa: E402


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=0, help="M (default 4 x the ranks)")
    p.add_argument("--micro-rows", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=0, help="blocks (default 8 per rank)")
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="timed steps per schedule (after 2 warm-up steps)")
    p.add_argument("--schedules", default="gpipe,1f1b,eager-1f1b")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin each rank to a core of its own")
    p.add_argument(
        "--give-back",
        dest="keep",
        action="store_false",
        help="let malloc hand freed memory back to the OS between steps (page faults in every step)",
    )
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def _peak_growth(step, state, batch):
    """(new state, MiB this rank's memory grew by during one step)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        trim()
        reset_peak()
        base = status_mib("VmRSS")
    state, _ = step(state, batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = status_mib("VmHWM")
    return state, peak - base


def _within(inner, outer) -> bool:
    """Whether profiler event `inner` ran inside `outer`."""
    return outer.time_range.start <= inner.time_range.start and inner.time_range.end <= outer.time_range.end


def _schedule_seconds(prof, m: int) -> tuple[list, list]:
    """(per step: its schedule's span in seconds, per step: this rank's compute seconds per microbatch by
    kind, receives left out) from the profiled steps' ranges."""
    events = prof.events()
    spans = sorted((e for e in events if e.name == pipeline.RANGE_SCHEDULE), key=lambda e: e.time_range.start)
    recvs = [e for e in events if e.name == pipeline.RANGE_RECV]
    actions = pipeline.action_ranges(events)
    walls, per_step = [], []
    for span in spans:
        each = {"F": [0.0] * m, "B": [0.0] * m}
        for kind, micro, e in actions:
            if _within(e, span):
                waited = sum(r.time_range.elapsed_us() for r in recvs if _within(r, e))
                each[kind][micro] = (e.time_range.elapsed_us() - waited) / 1e6
        walls.append(span.time_range.elapsed_us() / 1e6)
        per_step.append(each)
    return walls, per_step


def _held_mib(prof) -> float:
    """The most tensor memory (MiB) the profiled step's actions held at the end of a forward: the running
    sum of each action's allocations less its frees."""
    live = held = 0
    for kind, _, e in pipeline.action_ranges(prof.events()):
        live += e.cpu_memory_usage if not torch.cuda.is_available() else e.device_memory_usage
        if kind == "F":
            held = max(held, live)
    return held / 2**20


def _measure(name, pipe, params, batch, args, m):
    """Step seconds, this rank's compute and schedule seconds per timed step, and its peak growth under `name`."""
    opt = optim.adamw(1e-4)
    step = pipeline.make_pipeline_step(pipe, opt, microbatches=m, schedule=name)
    state = init_state(pipe.params(params), opt)
    for _ in range(2):
        state, _ = step(state, batch)
    dist.barrier()
    state, peak = _peak_growth(step, state, batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        state, _ = step(state, batch)
    held = _held_mib(prof)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, batch)
    float(metrics["loss"])
    dist.barrier()
    seconds = (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the same steps again, their actions timed
        for _ in range(args.steps):
            state, metrics = step(state, batch)
        float(metrics["loss"])
    dist.barrier()
    walls, actions = _schedule_seconds(prof, m)
    per = args.steps * m  # microbatches timed
    spent = {k: sum(sum(a[k]) for a in actions) for k in ("F", "B")}  # compute seconds by kind
    return {
        "step_s": seconds,
        "busy_s": [sum(a["F"]) + sum(a["B"]) for a in actions],
        "span_s": walls,
        "actions_s": actions,
        "peak_mib": peak,
        "held_mib": held,
        "forward_s": spent["F"] / per,
        "backward_s": spent["B"] / per,
    }


def _bubbles(every: list) -> tuple[list, list]:
    """(each rank's bubble over all timed steps, the mean over ranks of each step's bubble).

    The schedules of all ranks start together (after the last step's collectives): a step's span is
    the longest rank's, and a rank's bubble the share of it the rank did not compute."""
    spans = [max(r["span_s"][s] for r in every) for s in range(len(every[0]["span_s"]))]
    per_rank = [1.0 - sum(r["busy_s"]) / sum(spans) for r in every]
    per_step = [sum(1.0 - r["busy_s"][s] / span for r in every) / len(every) for s, span in enumerate(spans)]
    return per_rank, per_step


def _replayed(name: str, n: int, m: int, every: list) -> list:
    """Per timed step, the mean over ranks of the bubble the schedule leaves when each microbatch's
    forward and backward on each rank cost what they were measured to cost in that step and
    transfers are free (`parallel.pipeline_schedule.simulate`): the measured bubble less the pipeline's own share."""
    out = []
    for s in range(len(every[0]["actions_s"])):
        idle = schedules.simulate(
            name, n, m, [r["actions_s"][s]["F"] for r in every], [r["actions_s"][s]["B"] for r in every]
        )
        out.append(sum(idle) / n)
    return out


def main():
    args = _args()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    if args.pin and not torch.cuda.is_available() and n <= (os.cpu_count() or 1):
        os.sched_setaffinity(0, {rank})  # a core of its own: less noise in the stages' times
    if args.keep and not torch.cuda.is_available():
        keep_freed()  # freed activations reused, not page-faulted in again every step
    m = args.microbatches or 4 * n
    layers = args.n_layer or 8 * n  # stages far heavier than the embedding and the head
    cfg = gpt.GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=layers,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        bias=False,
    )
    template = gpt.GPT(cfg, key=rng.key(0))
    params = dict(template.named_parameters())
    pipe = pipeline.place(gpt.make_loss_fn(template, staged=True), params)
    g = torch.Generator().manual_seed(0)
    rows = m * args.micro_rows
    batch = (
        torch.randint(0, args.vocab, (rows, args.seq), generator=g),
        torch.randint(0, args.vocab, (rows, args.seq), generator=g),
    )
    theory = schedules.bubble_fraction(n, m)
    out = {
        "ranks": n,
        "microbatches": m,
        "layers": layers,
        "seq": args.seq,
        "n_embd": args.n_embd,
        "micro_rows": args.micro_rows,
        "theoretical_bubble": theory,
        "schedules": {},
    }
    for name in args.schedules.split(","):
        mine = _measure(name, pipe, params, batch, args, m)
        every = [None] * n
        dist.all_gather_object(every, mine)
        bubbles, steps = _bubbles(every)
        median = sorted(steps)[len(steps) // 2]
        replayed = _replayed(name, n, m, every)
        own = (sum(steps) - sum(replayed)) / len(steps)  # transfers, waits and Python between actions
        # what the schedule leaves idle for these stages' measured costs (the formula assumes equal stages)
        expected = schedules.simulate(name, n, m, [r["forward_s"] for r in every], [r["backward_s"] for r in every])
        row = {
            "step_s": max(r["step_s"] for r in every),
            "bubble": sum(bubbles) / n,
            "bubble_per_rank": bubbles,
            "bubble_median_step": median,
            "bubble_per_step": steps,
            "expected_bubble": sum(expected) / n,
            "expected_bubble_per_rank": expected,
            "replayed_bubble": sum(replayed) / len(replayed),
            "replayed_bubble_per_step": replayed,
            "pipeline_share": own,
            "forward_s_per_rank": [r["forward_s"] for r in every],
            "backward_s_per_rank": [r["backward_s"] for r in every],
            "peak_mib_per_rank": [r["peak_mib"] for r in every],
            "activations_mib_per_rank": [r["held_mib"] for r in every],
            "held_per_rank": [schedules.held(schedules.schedule(name, n, m, r)) for r in range(n)],
        }
        out["schedules"][name] = row
        if rank == 0:
            print(
                f"{name}: {row['step_s']:.3f} s/step, bubble {row['bubble']:.3f} (median step {median:.3f}; "
                f"theory {theory:.3f}, for these "
                f"stages' costs {row['expected_bubble']:.3f}, for these microbatches' costs "
                f"{row['replayed_bubble']:.3f} + the pipeline's own {own:+.3f}; per rank "
                + ", ".join(f"{b:.3f}" for b in bubbles)
                + " vs "
                + ", ".join(f"{b:.3f}" for b in expected)
                + "), peak MiB per rank "
                + ", ".join(f"{p:.1f}" for p in row["peak_mib_per_rank"])
                + ", activations held MiB per rank "
                + ", ".join(f"{p:.1f}" for p in row["activations_mib_per_rank"]),
                flush=True,
            )
    s = out["schedules"]
    if "gpipe" in s and "1f1b" in s:
        gp, fb = s["gpipe"], s["1f1b"]
        out["peak_ratio_1f1b_over_gpipe"] = [a / b for a, b in zip(fb["peak_mib_per_rank"], gp["peak_mib_per_rank"])]
        out["activations_ratio_1f1b_over_gpipe"] = [
            a / b for a, b in zip(fb["activations_mib_per_rank"], gp["activations_mib_per_rank"])
        ]
        # the target: 1F1B's activations <= N / M of GPipe's, give or take one microbatch's (GPipe's / M)
        out["activations_target_met"] = all(
            a <= (n / m) * b + b / m for a, b in zip(fb["activations_mib_per_rank"], gp["activations_mib_per_rank"])
        )
        if rank == 0:
            print(
                "1F1B / GPipe per rank: peak "
                + ", ".join(f"{x:.2f}" for x in out["peak_ratio_1f1b_over_gpipe"])
                + ", activations held "
                + ", ".join(f"{x:.2f}" for x in out["activations_ratio_1f1b_over_gpipe"])
                + f" (N / M = {n / m:.2f}, + 1 / M = {1 / m:.2f} for one microbatch: "
                + ("met" if out["activations_target_met"] else "missed")
                + "; microbatches held by 1F1B "
                + ", ".join(str(h) for h in fb["held_per_rank"])
                + f" of {m})",
                flush=True,
            )
    if "gpipe" in s and "eager-1f1b" in s:  # one microbatch more than 1F1B on every rank but the last
        gp, ea = s["gpipe"], s["eager-1f1b"]
        out["activations_ratio_eager_1f1b_over_gpipe"] = [
            a / b for a, b in zip(ea["activations_mib_per_rank"], gp["activations_mib_per_rank"])
        ]
        if rank == 0:
            print(
                "eager 1F1B / GPipe per rank: activations held "
                + ", ".join(f"{x:.2f}" for x in out["activations_ratio_eager_1f1b_over_gpipe"])
                + " (microbatches held "
                + ", ".join(str(h) for h in ea["held_per_rank"])
                + f" of {m})",
                flush=True,
            )
    if rank == 0 and args.json:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
