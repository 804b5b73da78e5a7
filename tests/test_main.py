"""`python -m functrain.main` end to end, in subprocesses: a short tiny run, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "gpt.py")


def _main(*args, cwd, timeout=900):
    """Runs `python -m functrain.main --config=configs/gpt.py:tiny ARGS` in `cwd`."""
    cmd = [sys.executable, "-m", "functrain.main", f"--config={CONFIG}:tiny", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # One intra-op thread: on a busy 2-core CI box two spinning OpenMP threads make the tiny eager
    # run 5-8x slower (measured 0.39 vs 0.05 s/step); the test checks behaviour, not speed.
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _error_line(proc):
    """The last non-empty stderr line, after checking the failure is one clean line."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines, "no error message on stderr"
    errors = [ln for ln in lines if ln.startswith("functrain: error:")]
    assert len(errors) == 1, proc.stderr
    assert lines[-1] == errors[0], proc.stderr
    return errors[0]


def test_tiny_run_trains_logs_and_samples(tmp_path):
    workdir = tmp_path / "run"
    proc = _main(
        "--config.compile=False",
        "--config.steps=60",
        "--config.log_every=10",
        "--config.eval_every=30",
        f"--workdir={workdir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

    rows = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [10, 20, 30, 40, 50, 60]
    for r in train_rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(r), r
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val_rows] == [30, 60]

    first, last = train_rows[0]["loss"], train_rows[-1]["loss"]
    # Uniform over bytes is ln 256 = 5.55; 60 steps of the tiny model get well below it.
    assert first < 5.6
    assert last < first - 0.3, [r["loss"] for r in train_rows]
    assert val_rows[-1]["val_loss"] < val_rows[0]["val_loss"]

    out = proc.stdout
    assert "sample:" in out
    sample = out.split("sample:", 1)[1].strip()
    assert sample.startswith("def") and len(sample) > 20  # the prompt plus generated text
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["loss"] == pytest.approx(last)


def test_unknown_config_key_is_one_clear_error_line(tmp_path):
    proc = _main("--config.optim.lrr=1", f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    line = _error_line(proc)
    assert "lrr" in line
    assert not (tmp_path / "run").exists()  # it failed before doing anything


def test_unknown_config_key_error_quotes_the_flag_as_typed(tmp_path):
    proc = _main("--config.optim.lrr=1", f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    line = _error_line(proc)
    assert "--config.optim.lrr" in line and "\\" not in line, line


@pytest.mark.parametrize("value, expected", [(120, 120), (0, None)])
def test_dist_timeout_reaches_the_parallel_setup(tmp_path, monkeypatch, value, expected):
    """--config.dist_timeout_s is the collective timeout `parallel.setup` gets (0: torch's default);
    that setup gives it to every mesh group is tests/test_parallel_dist.py's."""
    import importlib.util

    from functrain import parallel
    from functrain.trainer import main

    spec = importlib.util.spec_from_file_location("gpt_config", CONFIG)
    gpt_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt_config)
    seen = {}

    def setup(mesh_config, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("setup reached")

    monkeypatch.setattr(parallel, "setup", setup)
    config = gpt_config.get_config("tiny")
    config.dist_timeout_s = value
    with pytest.raises(RuntimeError, match="setup reached"):
        main.train(config, tmp_path / "run")
    assert seen == {"timeout_s": expected}


@pytest.mark.parametrize(
    "flags, world, expected",
    [
        ("--config.batch_size=0", None, "batch_size=0 is out of range"),
        ("--config.optim.b2=1.5", None, "optim.b2=1.5 is out of range"),
        ("--config.remat=sometimes", None, "remat='sometimes' is out of range"),
        ("--config.model.name=nope", None, "model.name='nope'"),
        ("--config.optim.lrr=1", None, "optim.lrr"),
        ("--config.model.n_head=3", None, "model.n_embd=64, model.n_head=3: n_head must divide n_embd"),
        (
            "--config.batch_size=15 --config.accum_steps=2",
            None,
            "batch_size=15 must divide by data-parallel ranks (1) x accum_steps (2)",
        ),
        ("--config.mesh.dp_shard=2", None, "product 2 != world size 1; fix --config.mesh.*"),
        ("--config.batch_size=15", "2", "batch_size=15 must divide by data-parallel ranks (2) x accum_steps (1)"),
        ("--config.mesh.tp=2 --config.batch_size=15", "4", "data-parallel ranks (2)"),
        ("--config.mesh.tp=3", "4", "world size 4 is not divisible by 3"),
        ("--config.compile_unit=regions", None, "compile_unit='regions'"),
        ("--config.mesh.pp=2 --config.accum_steps=2", "2", "set --config.pp.microbatches instead and accum_steps=1"),
        (
            "--config.mesh.pp=2 --config.pp.microbatches=3",
            "2",
            "batch_size=16 must divide by data-parallel ranks (1) x pp.microbatches (3)",
        ),
        ("--config.mesh.pp=3", "2", "pp=3: pipeline ranks must be a positive divisor of the world size 2"),
        ("--config.mesh.pp=4 --config.model.n_layer=2", "4", "mesh.pp=4 pipeline stages over model.n_layer=2 blocks"),
        ("--config.pp.schedule=zb", None, "pp.schedule='zb' is out of range: one of '1f1b', 'eager-1f1b', 'gpipe'"),
    ],
)
def test_bad_config_is_reported_before_torch_loads(tmp_path, flags, world, expected):
    """Every config check (the loop's, the optimizer's, the family's, the mesh against torchrun's
    world size, the batch against the mesh) is torch-free and runs first: a typo costs a user ~0.4 s,
    not the ~3-5 s of importing torch, TensorStore and the compiler."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['functrain.main', {f'--config={CONFIG}:tiny'!r}, *{flags.split()!r}]\n"
        "try:\n"
        "    runpy.run_module('functrain.main', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exit:\n"
        "    print('exit', exit.code, sorted(m for m in ('torch', 'tensorstore', 'numpy') if m in sys.modules))\n"
        "    raise\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    if world is not None:  # as torchrun sets them (rank 0 of `world`): no process group is started
        env.update(WORLD_SIZE=world, RANK="0")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.strip() == "exit 2 []", proc.stdout + proc.stderr
    assert expected in _error_line(proc)


@pytest.mark.slow
def test_missing_data_path_is_one_clear_error_line(tmp_path):
    missing = tmp_path / "nonexistent"
    proc = _main(
        "--config.compile=False", f"--config.data.path={missing}", f"--workdir={tmp_path / 'run'}", cwd=tmp_path
    )
    line = _error_line(proc)
    assert str(missing) in line


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--config.batch_size=0", "batch_size=0 is out of range: an integer >= 1 (--config.batch_size)"),
        (
            "--config.model.block_size=0",
            "model.block_size=0 is out of range: an integer >= 1 (--config.model.block_size)",
        ),
        ("--config.checkpoint.keep=0", "checkpoint.keep=0 is out of range: an integer >= 1 (--config.checkpoint.keep)"),
        ("--config.eval_batches=0", "eval_batches=0 is out of range: an integer >= 1 (--config.eval_batches)"),
        (
            "--config.sample.temperature=-1",
            "sample.temperature=-1.0 is out of range: a number >= 0.0 (--config.sample.temperature)",
        ),
        ("--config.precision=fp8", "precision='fp8' is out of range: one of 'fp32', "),
        ("--config.remat=sometimes", "remat='sometimes' is out of range: 'auto', 'none', 'full' or a positive int N"),
        ("--config.optim.mu_dtype=int8", "optim.mu_dtype='int8' is out of range: one of 'float32'"),
        ("--config.max_consecutive_skips=-1", "max_consecutive_skips=-1 is out of range: an integer >= 0"),
        ("--config.device=cuda:99", "device='cuda:99' but this torch "),  # no machine has 100 GPUs
        ("--config.device=mps", "device='mps' but this torch "),  # Apple's Metal: no Linux build has it
        (
            "--config.model.n_head=3",
            "model.n_embd=64, model.n_head=3: n_head must divide n_embd (each head gets "
            "n_embd / n_head channels); change either (--config.model.n_embd / --config.model.n_head)",
        ),
        (
            "--config.batch_size=15 --config.accum_steps=2",
            "batch_size=15 must divide by data-parallel ranks (1) x accum_steps (2)",
        ),
        ("--config.cuda_graphs=True", "cuda_graphs=True records the compiled step: it needs compile=True"),
        ("--config.cp_attention=ring", "cp_attention='ring' is out of range: one of 'zigzag', 'stream', 'mask'"),
        ("--config.mesh.cp=0", "mesh config dp_replicate=1 x dp_shard=-1 x cp=0 x tp=1: sizes must be positive or -1"),
        (
            "--config.compile=True --config.compile_unit=blocks --config.cuda_graphs=True",
            "cuda_graphs=True records the one-graph step: it needs compile_unit='step', not 'blocks'",
        ),
        (
            "--config.compile=True --config.cuda_graphs=True --config.device=cpu",
            "cuda_graphs=True needs a CUDA device; this run's device is cpu (drop --config.cuda_graphs)",
        ),
    ],
)
def test_bad_values_are_one_clear_error_line(tmp_path, flag, expected):
    proc = _main("--config.compile=False", *flag.split(), f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    line = _error_line(proc)
    assert expected in line, line


@pytest.mark.slow
def test_resume_takes_the_configs_hyperparameters_unless_told_otherwise(tmp_path):
    """Hyper-parameters are optimizer state: on resume the config's values replace the checkpoint's
    (printed), and `checkpoint.resume_hyperparams=checkpoint` keeps the checkpoint's."""
    common = [
        "--config.compile=False",
        "--config.steps=8",
        "--config.log_every=1",
        "--config.eval_every=8",
        "--config.eval_batches=1",
        "--config.sample.max_new_tokens=0",
        "--config.optim.schedule=constant",
        "--config.optim.warmup_steps=0",
        "--config.checkpoint.every=4",
    ]

    def lr_at_step(workdir, step):
        rows = [json.loads(ln) for ln in open(workdir / "metrics.jsonl")]
        return next(r["lr"] for r in rows if r.get("step") == step and "lr" in r)

    for policy, expected in (("config", 0.02), ("checkpoint", 0.01)):
        workdir = tmp_path / policy
        first = _main(f"--workdir={workdir}", *common, "--config.optim.lr=0.01", "--config.stop_at=4", cwd=tmp_path)
        assert first.returncode == 0, first.stderr[-2000:]
        second = _main(
            f"--workdir={workdir}",
            *common,
            "--config.optim.lr=0.02",
            "--config.optim.b2=0.9",
            f"--config.checkpoint.resume_hyperparams={policy}",
            cwd=tmp_path,
        )
        assert second.returncode == 0, second.stderr[-2000:]
        assert "restored checkpoint step 4" in second.stdout
        assert "b2 0.95 -> 0.9, lr 0.01 -> 0.02" in second.stdout, second.stdout
        assert lr_at_step(workdir, 4) == pytest.approx(0.01) and lr_at_step(workdir, 5) == pytest.approx(expected)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["workdir", "data.cache_dir"])
def test_a_workdir_or_cache_that_cannot_be_made_is_one_line(tmp_path, where):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # under a file: no directory can be made, even by root
    bad = blocker / "run"
    flags = (
        [f"--workdir={bad}"]
        if where == "workdir"
        else [f"--workdir={tmp_path / 'ok'}", f"--config.data.cache_dir={bad}"]
    )
    line = _error_line(_main("--config.compile=False", *flags, cwd=tmp_path))
    name = "workdir" if where == "workdir" else "data cache"
    assert line.startswith(
        f"functrain: error: {name} {bad}: cannot be created (Not a directory); pass a writable --workdir"
    ), line


@pytest.mark.parametrize(
    "config, expected",
    [
        ("configs/nope.py", "cannot load --config=configs/nope.py: [Errno 2] No such file or directory"),
        ("README.md", "cannot load --config=README.md: SyntaxError: "),
        ("configs/gpt.py:nope", "flag --config=configs/gpt.py:nope: ValueError: unknown variant 'nope'; use one of: "),
    ],
)
def test_a_config_file_that_cannot_load_is_one_line(tmp_path, config, expected):
    proc = subprocess.run(
        [sys.executable, "-m", "functrain.main", f"--config={config}", f"--workdir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _error_line(proc)
    assert line.startswith(f"functrain: error: {expected}"), line


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["compile", "eval"])
def test_sigterm_before_the_first_step_stops_cleanly(tmp_path, phase):
    """SIGTERM to the whole process group (the compiler's jobs too) while the first step compiles (no evaluation:
    4 s after the run's description), or as the scores before step 1 start (the default eval.tasks): rc 0, one
    line, no traceback, no step taken (or, a signal after the compile's last job, step 1 saved)."""
    import signal
    import time

    cmd = [
        sys.executable,
        "-m",
        "functrain.main",
        f"--config={CONFIG}:tiny",
        f"--workdir={tmp_path / 'run'}",
        "--config.model.n_layer=1",
        "--config.steps=2",
    ] + (["--config.eval.tasks="] if phase == "compile" else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines = []
    for line in proc.stdout:  # the run's description comes just before the first compile; "eval:" before the scores
        lines.append(line)
        if line.startswith("functrain: GPT" if phase == "compile" else "eval:"):
            break
    time.sleep(4.0 if phase == "compile" else 0.0)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    text = "".join(lines) + out
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert any(
        s in text
        for s in (
            "stopped (SIGTERM) while the first step compiled: no step taken, nothing to save",
            "stopped (SIGTERM) before step 1: no step taken, nothing to save",
            "stopped (SIGTERM) at step 1",
        )
    ), text[-3000:]
    assert ("step 1/2 | loss" in text) == ("stopped (SIGTERM) at step 1" in text), text[-3000:]


@pytest.mark.slow
def test_sigterm_during_the_scores_stops_within_seconds(tmp_path):
    """SIGTERM while the multiple-choice scores run (before step 1; 20,000 one-row forwards, about a minute when
    left to finish): the scoring stops between two batches and the run ends at once, rc 0, nothing trained."""
    import signal
    import time

    task = tmp_path / "mc.jsonl"
    task.write_text(
        "".join(
            json.dumps({"context": f"def f{i}(x):\n    return", "choices": [" x", " 1", " x + 1", " None"], "label": 0})
            + "\n"
            for i in range(5000)
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "functrain.main",
        f"--config={CONFIG}:tiny",
        f"--workdir={tmp_path / 'run'}",
        "--config.model.n_layer=1",
        "--config.steps=2",
        f"--config.eval.tasks={task}",
        "--config.eval.batch_size=1",
        "--config.eval.compile=False",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("eval:"):
            break
    time.sleep(2.0)  # into the scores
    signalled = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    waited = time.perf_counter() - signalled
    text = "".join(lines) + out
    assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
    assert "eval: stopped scoring mc at step 0" in text, text[-3000:]
    assert "stopped (SIGTERM) before step 1: no step taken, nothing to save" in text, text[-3000:]
    assert waited < 10, f"{waited:.1f}s from the signal to the exit"
