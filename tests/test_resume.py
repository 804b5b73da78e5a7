"""The main loop's checkpoint integration: bit-exact resume, crash safety, preemption, bad restores.

Each test runs `python -m functrain.main` (tiny variant, eager to keep it fast) in subprocesses.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from functrain import checkpoint as ckpt

pytestmark = pytest.mark.slow  # main-job runs, killed and resumed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
TINY = [
    "--config=configs/gpt.py:tiny",
    "--config.compile=False",
    "--config.log_every=1",
    "--config.eval_every=1000",
    "--config.eval_batches=1",
    "--config.sample.max_new_tokens=8",
    "--config.model.dropout=0.1",  # so the RNG stream must continue exactly too
    "--config.eval.tasks=",  # (multiple-choice scoring: tests/test_eval.py)
]


def _env():
    # one thread: two spinning OpenMP threads make the tiny run ~5x slower on a busy 2-core box
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def _main(workdir, *extra, check=True, base=TINY):
    """Runs the main job to completion; returns the CompletedProcess."""
    out = subprocess.run(
        [PYTHON, "-m", "functrain.main", f"--workdir={workdir}", *base, *extra],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(workdir):
    """{step: train loss} from metrics.jsonl (the last value logged for each step)."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _restore_all(workdir, step):
    """The checkpoint `step` of a run as plain tensors."""
    return ckpt.restore(os.path.join(workdir, "checkpoints", str(step))).result()


def test_resume_is_bit_exact(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _main(straight, "--config.steps=20", "--config.checkpoint.every=10")
    first = _main(resumed, "--config.steps=20", "--config.checkpoint.every=10", "--config.stop_at=10")
    assert "stopped (stop_at) at step 10" in first.stdout
    second = _main(resumed, "--config.steps=20", "--config.checkpoint.every=10")
    assert "restored checkpoint step 10" in second.stdout

    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == list(range(1, 21))
    assert [a[s] for s in range(1, 21)] == [b[s] for s in range(1, 21)]  # exact floats
    ta, tb = _restore_all(straight, 20), _restore_all(resumed, 20)
    flat_a, flat_b = dict(_named(ta)), dict(_named(tb))
    assert flat_a.keys() == flat_b.keys() and len(flat_a) > 10
    for name in flat_a:
        assert torch.equal(flat_a[name], flat_b[name]), name
    assert int(flat_b["step"]) == 20


def _named(tree):
    from functrain import tree as tree_lib

    return tree_lib.named_leaves(tree)


_STUCK_SECOND_SAVE = r"""
import sys, time
from functrain.checkpoint import writer
real = writer._merge_and_commit
calls = []
def stuck_on_second(*args, **kwargs):
    calls.append(1)
    if len(calls) >= 2:
        print("committing", flush=True)
        time.sleep(600)
    return real(*args, **kwargs)
writer._merge_and_commit = stuck_on_second
from functrain.trainer import main
sys.argv = ["functrain.main"] + sys.argv[1:]
main.run()
"""


def test_kill_9_during_async_save_keeps_previous_step_and_resumes(tmp_path):
    work = tmp_path / "run"
    args = [f"--workdir={work}", *TINY, "--config.steps=15", "--config.checkpoint.every=5"]
    p = subprocess.Popen(
        [PYTHON, "-c", _STUCK_SECOND_SAVE, *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.time() + 300
        for line in p.stdout:  # training logs, then the marker from inside step 10's commit
            if line.strip() == "committing" or time.time() > deadline:
                break
        assert line.strip() == "committing"
    finally:
        p.kill()  # SIGKILL in the middle of step 10's async save
        p.wait()
    ckdir = work / "checkpoints"
    assert sorted(os.listdir(ckdir)) == ["10.orbax-checkpoint-tmp", "5"]

    out = _main(work, "--config.steps=15", "--config.checkpoint.every=5")
    assert "restored checkpoint step 5" in out.stdout
    assert sorted(os.listdir(ckdir)) == ["10", "15"]  # tmp cleaned; keep=2 retention
    assert sorted(_losses(work))[-1] == 15


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_sigterm_or_ctrl_c_saves_the_step_and_exits_cleanly(tmp_path, sig):
    work = tmp_path / "run"
    p = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "functrain.main",
            f"--workdir={work}",
            *TINY,
            "--config.steps=100000",
            "--config.checkpoint.every=0",
        ],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(
            signal.SIGINT, signal.SIG_DFL
        ),  # as at a terminal (a background job ignores it)
    )
    for line in p.stdout:
        if line.startswith("step") and "loss" in line:
            break
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    if sig == signal.SIGINT:
        assert "Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again stops at once)" in stdout
    stopped = [ln for ln in stdout.splitlines() if ln.startswith(f"stopped ({sig.name}) at step ")]
    assert len(stopped) == 1, stdout[-2000:]
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert os.listdir(work / "checkpoints") == [str(step)]
    assert int(_restore_all(work, step)["step"]) == step


def test_restore_onto_another_model_is_one_clear_error(tmp_path):
    work = tmp_path / "run"
    _main(work, "--config.steps=2", "--config.checkpoint.every=2")
    out = _main(work, "--config.steps=4", "--config.model.n_embd=32", check=False)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("functrain: error: checkpoint ")
    assert "shape" in lines[-1] and "Traceback" not in out.stderr
    assert "init_from" not in lines[-1]  # the params changed: starting from them cannot help
    # Only the optimizer changed: the line says how to keep the params under the new one.
    out = _main(work, "--config.steps=4", "--config.optim.name=sgd", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    line = [ln for ln in out.stderr.strip().splitlines() if ln.strip()][-1]
    assert line.startswith(f"functrain: error: checkpoint {work / 'checkpoints' / '2'}: leaf 'opt_state."), line
    assert line.endswith(
        "; to keep its params under this optimizer, start a new --workdir with "
        f"--config.checkpoint.init_from={work / 'checkpoints' / '2'}"
    ), line
    fresh = _main(
        tmp_path / "fresh",
        "--config.steps=4",
        "--config.optim.name=sgd",
        f"--config.checkpoint.init_from={work / 'checkpoints' / '2'}",
    )
    assert "params initialized from checkpoint" in fresh.stdout  # the advice works


COMPILED = [a for a in TINY if a not in ("--config.compile=False", "--config.model.dropout=0.1")]


def _rows(workdir):
    """Every metrics row with a train loss, in file order (a resumed run repeats some steps)."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


@pytest.mark.numeric
@pytest.mark.exhaustive  # three compiled runs (~2-2.5 min CPU); kill -9 during a save and bit-exact resume keep
# their own tests here
def test_compiled_runs_are_reproducible_and_survive_kill_9(tmp_path):
    """The default (compiled) step is deterministic: a second run of the same command logs the same
    losses at every step, and one killed with SIGKILL mid-run and restarted continues exactly."""
    args = ["--config.steps=20", "--config.checkpoint.every=5"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _main(straight, *args, base=COMPILED)
    p = subprocess.Popen(
        [PYTHON, "-m", "functrain.main", f"--workdir={killed}", *COMPILED, *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in p.stdout:  # step 13's console line: step 12's metrics row is on disk by then
            if line.startswith("step 13/20"):
                break
    finally:
        p.kill()  # SIGKILL: no handler runs
        p.wait()
    before = _rows(killed)
    last = before[-1][0]
    assert last in (12, 13), last  # 13's row may or may not have been written before the kill
    out = _main(killed, *args, base=COMPILED)
    # Step 10's save is asynchronous: the kill may land before it committed, and then the run must
    # fall back to step 5 (an uncommitted step directory is never restored).
    restored = re.findall(r"restored checkpoint step (\d+)", out.stdout)
    assert restored in (["10"], ["5"]), out.stdout[-2000:]
    resumed = int(restored[0])
    want = {s: (loss, g) for s, loss, g in _rows(straight)}
    assert sorted(want) == list(range(1, 21))
    rows = _rows(killed)
    assert [s for s, _, _ in rows] == list(range(1, last + 1)) + list(range(resumed + 1, 21))
    for s, loss, g in rows:  # exact floats: the rows before the kill and the replayed ones alike
        assert (loss, g) == want[s], (s, loss, g, want[s])


def _without_guard(step_dir):
    """Rewrites a checkpoint as a version of functrain without `TrainState.guard` would have written it."""
    state = ckpt.restore(step_dir).result()
    del state["guard"]
    tmp = str(step_dir) + "-old"
    ckpt.save(tmp, state)
    import shutil

    shutil.rmtree(step_dir)
    os.rename(tmp, step_dir)


def test_a_checkpoint_without_a_field_of_the_state_stops_in_one_line(tmp_path):
    """A checkpoint whose state lacks a field (here the skip guard) does not resume on today's state: one line
    naming the leaf and how to keep its params."""
    run = tmp_path / "run"
    args = ["--config.steps=8", "--config.checkpoint.every=4"]
    _main(run, *args, "--config.stop_at=4")
    _without_guard(run / "checkpoints" / "4")
    out = _main(run, *args, check=False)
    line = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and line.startswith("functrain: error: checkpoint "), line
    assert "'guard.skipped' is missing" in line and "--config.checkpoint.init_from=" in line, line


def test_init_from_loads_params_only_onto_another_mesh(tmp_path):
    """`checkpoint.init_from` starts a 2-rank FSDP run from a 1-process run's params, fresh optimizer."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _main(src, "--config.steps=6", "--config.checkpoint.every=6")
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "functrain.main",
        f"--workdir={dst}",
        *TINY,
        "--config.steps=1",
        "--config.checkpoint.every=1",
        "--config.mesh.dp_shard=2",
        "--config.optim.lr=0",
        f"--config.checkpoint.init_from={src}",
    ]  # lr 0: the params pass unchanged
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"params initialized from checkpoint {src}/checkpoints/6" in out.stdout
    a, b = _restore_all(src, 6), _restore_all(dst, 1)
    for name, p in a["params"].items():
        assert torch.equal(b["params"][name], p), name
    assert int(b["step"]) == 1 and int(b["opt_state"][1][2]["count"]) == 1  # a fresh optimizer, one update
    assert not torch.equal(b["opt_state"][1][0]["mu"]["wte.weight"], a["opt_state"][1][0]["mu"]["wte.weight"])
    bad = _main(
        tmp_path / "bad", "--config.steps=1", f"--config.checkpoint.init_from={tmp_path / 'nowhere'}", check=False
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "functrain: error: checkpoint.init_from="
    )
    assert not (tmp_path / "bad").exists()  # stopped before the data and the workdir were made


def test_overlapped_restore_reports_its_read_time_apart_from_the_compile(tmp_path):
    """With async restore and a compiled step the restore line gives the whole wait (the compile)
    and, apart, when the bytes were in: the step compiling on the fresh state must not read as a
    slow restore."""

    from functrain import init_state, optim
    from functrain.trainer import restore

    params = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    saved = init_state(params, optim.adamw(1e-3), seed=1)
    with ckpt.Manager(str(tmp_path / "checkpoints"), every=1) as mgr:
        mgr.save(3, saved)
        mgr.wait()
        fresh = init_state({k: torch.zeros_like(v) for k, v in params.items()}, optim.adamw(1e-3), seed=2)
        config = _run_config(compile=True, async_restore=True)
        compiles = []

        def slow_compile(state, batch):  # stands in for the first call of a compiled step
            compiles.append(batch)
            time.sleep(1.0)

        lines = []
        restored = restore.maybe_restore(mgr, fresh, slow_compile, lambda step: step, config, lines.append)
    assert compiles == [3]
    assert torch.equal(restored.params["w"], params["w"]) and int(restored.step) == int(saved.step)
    match = re.fullmatch(
        r"restored checkpoint step 3 in ([\d.]+)s \(compile overlapped; its bytes were read in "
        r"([\d.]+)s\)",
        lines[0],
    )
    assert match, lines
    total, read = map(float, match.groups())
    assert total >= 1.0 and read <= total


def test_init_from_is_checked_first_unless_the_run_resumes(tmp_path):
    """A bad `checkpoint.init_from` stops before data and model are made, but a run resuming from
    its own workdir never reads it (its source may be gone by then)."""
    import ml_collections

    from functrain import config_checks
    from functrain.trainer import loop, main

    config = ml_collections.ConfigDict({"checkpoint": {"init_from": str(tmp_path / "gone")}})
    with pytest.raises(config_checks.ConfigError, match="^checkpoint.init_from=.*gone.*no committed checkpoint there"):
        main._check_init_from(config, tmp_path / "run", loop)
    step = tmp_path / "run" / "checkpoints" / "3"
    step.mkdir(parents=True)
    with pytest.raises(config_checks.ConfigError):  # not committed: a crashed save is not a resume
        main._check_init_from(config, tmp_path / "run", loop)
    (step / "commit_success.txt").write_text("committed")
    main._check_init_from(config, tmp_path / "run", loop)  # resumes: init_from not read
    config.checkpoint.init_from = ""
    main._check_init_from(config, tmp_path / "nowhere", loop)


def _strict_json(path):
    """A JSON file parsed strictly (NaN / Infinity are not JSON)."""

    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    return json.loads(open(path).read(), parse_constant=refuse)


def test_rerunning_a_finished_run_trains_nothing_and_keeps_its_summary(tmp_path):
    """The same command again after a run finished: one line says there is nothing to train, and
    summary.json keeps the run's losses (it was rewritten with loss null and val_loss NaN)."""
    args = ["--config.steps=4", "--config.checkpoint.every=4", "--config.eval_every=4"]
    _main(tmp_path, *args)
    first = _strict_json(tmp_path / "summary.json")
    assert first["steps"] == 4 and first["loss"] == _losses(tmp_path)[4] and math.isfinite(first["val_loss"])
    again = _main(tmp_path, *args)
    assert "step 4 has reached steps=4: nothing to train (raise --config.steps to train on)" in again.stdout
    second = _strict_json(tmp_path / "summary.json")
    assert {k: second[k] for k in ("steps", "loss", "val_loss")} == {k: first[k] for k in ("steps", "loss", "val_loss")}
    assert second["sample"] == first["sample"]  # the same params and key: the same text


def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path, monkeypatch, capsys):
    """The flag's handler: the first SIGINT asks for a clean stop, the second raises
    KeyboardInterrupt, which `functrain.main` turns into one line and exit status 130."""
    from functrain.trainer import main, preemption

    lines = []
    # Python's own Ctrl-C handler to start from, whatever this process inherited: a process started
    # in the background by a shell without job control (e.g. `(nohup pytest &)`) has SIGINT ignored,
    # and the flag then leaves it so (tested below)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with preemption.PreemptionFlag(lines.append) as flag:
            assert signal.getsignal(signal.SIGINT) == flag._handle  # installed (pytest runs tests on the main thread)
            os.kill(os.getpid(), signal.SIGINT)
            assert flag.requested() and flag.reason == "SIGINT" and len(lines) == 1
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs at the next bytecode: well before this ends
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with preemption.PreemptionFlag(lines.append):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # an ignored Ctrl-C is left ignored
    finally:
        signal.signal(signal.SIGINT, inherited)

    def interrupted(config, workdir):
        raise KeyboardInterrupt

    monkeypatch.setattr(main, "train", interrupted)
    monkeypatch.setattr(main, "_CONFIG", type("Flag", (), {"value": {}})())  # a loaded config: it has keys()
    monkeypatch.setattr(main, "_WORKDIR", type("Flag", (), {"value": str(tmp_path)})())
    monkeypatch.setattr(main, "_EXPORT_HF", type("Flag", (), {"value": None})())
    monkeypatch.setattr(main, "_CONFIG_DUMP", type("Flag", (), {"value": False})())
    with pytest.raises(SystemExit) as exit_:
        main.main([])
    assert exit_.value.code == 130
    assert (
        capsys.readouterr().err
        == "functrain: interrupted; the same command resumes from the last committed checkpoint\n"
    )


_AGREE_WORKER = """
import os, signal
import torch.distributed as dist
from functrain.trainer.preemption import PreemptionFlag
dist.init_process_group("gloo")
with PreemptionFlag() as flag:
    before = flag.agree()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    print("agreed", before, flag.agree(), flag.signalled())
dist.destroy_process_group()
"""


def test_the_ranks_agree_on_a_signal_before_the_first_step(tmp_path):
    """A SIGTERM to one rank during the setup: every rank's `agree()` says so (a blocking all-reduce), so all of
    them stop before step 1 together."""
    from _dist_launch import run_ranks

    script = tmp_path / "agree.py"
    script.write_text(_AGREE_WORKER)
    outs = run_ranks(str(script), [], 2, timeout=120)
    assert "agreed False True False" in outs[0], outs[0]
    assert "agreed False True True" in outs[1], outs[1]


def test_a_corrupt_latest_step_names_the_command_that_resumes_from_the_one_before(tmp_path):
    """A corrupt newest checkpoint: one line with the `mv` that lets the same command resume from the step before;
    run as said, the resume takes that step."""

    from functrain import init_state, optim
    from functrain.trainer import restore

    params = {"w": torch.arange(6.0).reshape(2, 3)}
    config = _run_config(compile=False, async_restore=False)
    root = tmp_path / "checkpoints"
    with ckpt.Manager(str(root), every=1, keep=3) as mgr:
        for step in (2, 4):
            mgr.save(step, init_state({"w": params["w"] * step}, optim.sgd(0.1), seed=0))
            mgr.wait()
    (root / "4" / "default" / "_METADATA").write_text("{not json")
    fresh = init_state({"w": torch.zeros(2, 3)}, optim.sgd(0.1), seed=0)
    with ckpt.Manager(str(root), every=1, keep=3) as mgr:
        with pytest.raises(ckpt.CheckpointError) as info:
            restore.maybe_restore(mgr, fresh, None, lambda s: s, config, print)
    line = str(info.value)
    assert (
        "\n" not in line
        and f"to resume from step 2, move this one aside (mv {root / '4'} {root / '4'}.corrupt)" in line
    )
    os.rename(root / "4", root / "4.corrupt")
    with ckpt.Manager(str(root), every=1, keep=3) as mgr:
        restored = restore.maybe_restore(mgr, fresh, None, lambda s: s, config, lambda _: None)
    assert torch.equal(restored.params["w"], params["w"] * 2)
    assert (root / "4.corrupt" / "default").is_dir()  # nothing lost


def _run_config(*, compile: bool, async_restore: bool):
    """A run's whole config (the trainer's keys and the data's), as `restore.maybe_restore` reads it."""
    from functrain.trainer.defaults import data_config, trainer_config

    config = trainer_config()
    config.data = data_config()
    config.compile, config.checkpoint.async_restore, config.checkpoint.resume_hyperparams = (
        compile,
        async_restore,
        "config",
    )
    return config
