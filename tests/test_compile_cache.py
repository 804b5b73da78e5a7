"""functrain.compiler.cache: mode validation and directories, and a real warm start across processes.

The warm-start tests compile a tiny MLP train step (the real `make_train_step`: grad, clipped AdamW
with a warm-up cosine schedule, metrics; its two graphs, the loss and its grads and the update) in fresh
Python processes that share a cache directory set through `compile_cache.setup`: the first compiles cold
and saves both graphs whole (`compiler.saved_steps`), the next ones must load them (hits, no Dynamo
trace, no miss) and compute
bit-identical results, equal to a plain `torch.compile` of the step. The hyper-parameters are
tensors in the optimizer state, so an LR sweep is warm too; another model of the same shapes is not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from functrain.compiler import cache as compile_cache

pytestmark = pytest.mark.slow  # inductor compiles in subprocesses

ISA = torch.backends.cpu.get_cpu_capability().lower()  # the subdirectory every mode keys by
PIECES = 2  # the step's graphs, each saved whole: the loss and its grads, the update (the MLP has no alike blocks)

REPO = Path(__file__).resolve().parent.parent

_WORKER = r"""
import json, os, sys
import torch
from functrain import init_state, make_train_step, optim, parallel
from functrain.compiler import cache as compile_cache

cache = compile_cache.setup(sys.argv[1], sys.argv[2])
act = {"relu": torch.nn.ReLU(), "leaky": torch.nn.LeakyReLU(float(os.environ.get("WORKER_SLOPE", "0.1")))}.get(
    os.environ.get("WORKER_ACT", ""), torch.nn.Tanh())  # (the same shapes in every case)

def make_loss_fn(model):  # (the model in the loss's closure, as the families build theirs)
    def loss_fn(params, batch, key):
        x, y = batch
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean(), {}
    return loss_fn

model = torch.nn.Sequential(torch.nn.Linear(4, 8), act, torch.nn.Linear(8, 1))
with torch.no_grad():
    for i, p in enumerate(model.parameters()):
        p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (i + 1) / 4)
loss_fn = make_loss_fn(model)

lr = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine(lr, 0, 10), weight_decay=0.1))
state = init_state(model, opt)
mesh_copies = None
if os.environ.get("WORKER_MESH"):  # params and optimizer state as DTensors on a 1-process mesh
    import copy, pickle
    mesh = parallel.setup({"dp_shard": -1}, mesh_on_single_process=True).mesh
    hash(mesh)  # caches the per-process hash that the mesh's pickle leaves out
    mesh_copies = [pickle.loads(pickle.dumps(mesh)) == mesh, copy.deepcopy(mesh) == mesh,
                   hash(pickle.loads(pickle.dumps(mesh))) == hash(mesh)]
    state = parallel.shard_state(state, mesh)
step = make_train_step(loss_fn, opt, donate=False)
x = torch.linspace(-2, 2, 32).reshape(8, 4)
batch = (x, x.sum(1, keepdim=True).sin())
losses = []
for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(metrics["loss"].item())
print(json.dumps({"dir": str(cache), "stats": compile_cache.stats(), "losses": losses,
                  "params": {k: v.tolist() for k, v in parallel.gather(state.params).items()},
                  "report": compile_cache.report(cache), "mesh_copies": mesh_copies}))
"""


def _compile_in_subprocess(mode: str, workdir: Path, *args: str, extra_env: dict | None = None) -> dict:
    """Runs the worker in a fresh Python process (`extra_env` added to its environment); returns
    what it printed."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "TORCHINDUCTOR_CACHE_DIR",
            "TORCHINDUCTOR_FX_GRAPH_CACHE",
            "TORCHINDUCTOR_AUTOGRAD_CACHE",
            "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
        )
    }
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(extra_env or {}))
    script = workdir / "worker.py"  # (a file: a saved step checks the sources it traced)
    script.write_text(_WORKER)
    out = subprocess.run(
        [sys.executable, str(script), mode, str(workdir), *args],
        env=env,
        cwd=str(workdir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    """The first (cold) compile, in mode "workdir" under a fresh workdir: (workdir, result)."""
    workdir = tmp_path_factory.mktemp("run")
    return workdir, _compile_in_subprocess("workdir", workdir)


def _warm(stats: dict) -> bool:
    """Whether a process loaded its step's graphs whole and compiled nothing."""
    return stats["step_hit"] == PIECES and not any(stats[k] for k in ("step_miss", "fxgraph_miss", "aot_miss"))


def test_first_process_compiles_cold(cold_run):
    workdir, first = cold_run
    keyed = workdir.absolute() / "compile_cache" / ISA
    assert first["dir"] == str(keyed)
    s = first["stats"]
    assert s["step_miss"] == PIECES and s["aot_miss"] > 0 and s["step_hit"] == 0 and s["aot_hit"] == 0, s
    assert len(list((keyed / "steps").glob("*.pt2step"))) == PIECES
    assert f"whole steps 0/{PIECES}" in first["report"]


def test_second_process_with_same_dir_is_warm(cold_run, tmp_path):
    workdir, first = cold_run
    second = _compile_in_subprocess(str(workdir / "compile_cache"), tmp_path)  # the same dir, as a path
    assert second["dir"] == first["dir"]
    assert _warm(second["stats"]), second["stats"]
    assert second["losses"] == first["losses"] and second["params"] == first["params"]
    assert f"{PIECES} hits, 0 misses" in second["report"] and f"whole steps {PIECES}/0" in second["report"]


def test_saved_step_computes_what_torch_compile_does(cold_run, tmp_path):
    """Mode "off" saves nothing: the plain `torch.compile`d step, the same numbers bit for bit."""
    workdir, first = cold_run
    plain = _compile_in_subprocess("off", tmp_path)
    assert plain["stats"]["step_hit"] == plain["stats"]["step_miss"] == 0, plain["stats"]
    assert plain["losses"] == first["losses"] and plain["params"] == first["params"]


def test_another_model_of_the_same_shapes_is_compiled_again(cold_run, tmp_path):
    """ReLU for Tanh: the same parameters and inputs, so only the key (the model's fingerprint) tells."""
    workdir, first = cold_run
    run = _compile_in_subprocess(str(workdir / "compile_cache"), tmp_path, extra_env={"WORKER_ACT": "relu"})
    assert run["stats"]["step_miss"] == 1 and run["stats"]["step_hit"] == 1, run["stats"]  # the update: the same
    assert run["losses"][0] != first["losses"][0]


def test_a_constant_the_trace_reads_is_checked_at_load(tmp_path):
    """LeakyReLU's slope, 0.1 then 0.3: one key (a number in the model counts by its type), and the
    saved loss graph's guard on the slope tells them apart: a second entry under its key (the update is
    the same one), and each process its own numbers."""
    cache = str(tmp_path / "cache")
    runs = {}
    for slope in ("0.1", "0.3", "0.1"):
        env = {"WORKER_ACT": "leaky", "WORKER_SLOPE": slope}
        runs.setdefault(slope, []).append(_compile_in_subprocess(cache, tmp_path, extra_env=env))
    assert [r["stats"]["step_miss"] for r in runs["0.1"] + runs["0.3"]] == [PIECES, 0, 1]
    assert len(list(Path(cache, ISA, "steps").glob("*.pt2step"))) == PIECES + 1
    assert len({Path(p).name.rsplit("-", 1)[0] for p in Path(cache, ISA, "steps").glob("*.pt2step")}) == PIECES
    cold, warm = runs["0.1"]
    assert warm["losses"] == cold["losses"] and warm["params"] == cold["params"]
    assert runs["0.3"][0]["params"] != cold["params"]


def test_lr_sweep_compiles_once(cold_run, tmp_path):
    """Other learning rates (the schedule's peak, a tensor in the optimizer state) load the saved step:
    the schedule closes over its float peak, which the step never reads."""
    workdir, first = cold_run
    seen = [first["losses"][1]]
    for lr in ("0.05", "0.2", "0.3"):
        run = _compile_in_subprocess(str(workdir / "compile_cache"), tmp_path, lr)
        assert _warm(run["stats"]), (lr, run["stats"])
        assert run["losses"][0] == first["losses"][0]  # the first loss is before any update
        seen.append(run["losses"][1])
    assert len(set(seen)) == 4  # each rate really trained differently


def test_copied_workdir_is_warm(cold_run, tmp_path):
    """Mode "workdir" is portable: a copy of the workdir at another path compiles warm."""
    workdir, first = cold_run
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(workdir, moved)
    third = _compile_in_subprocess("workdir", moved)
    assert third["dir"] == str(moved.absolute() / "compile_cache" / ISA)
    assert _warm(third["stats"]), third["stats"]
    assert third["losses"] == first["losses"] and third["params"] == first["params"]


def test_sharded_step_is_warm_in_a_process_with_another_string_hash_seed(tmp_path):
    """A step over DTensors takes the DeviceMesh as a graph input, and torch 2.13 pickled the mesh's
    per-process string hash into both cache keys: every process missed (functrain.compiler.mesh_key).
    Two processes with different PYTHONHASHSEEDs, params and AdamW state sharded on a 1-process mesh."""
    cache = str(tmp_path / "cache")
    first = _compile_in_subprocess(cache, tmp_path, extra_env={"WORKER_MESH": "1", "PYTHONHASHSEED": "1"})
    assert first["stats"]["fxgraph_miss"] > 0 and first["stats"]["aot_miss"] > 0, first["stats"]
    second = _compile_in_subprocess(cache, tmp_path, extra_env={"WORKER_MESH": "1", "PYTHONHASHSEED": "2"})
    s = second["stats"]
    assert s["fxgraph_hit"] > 0 and s["aot_hit"] > 0, s
    assert s["fxgraph_miss"] == 0 and s["aot_miss"] == 0, s
    assert second["losses"] == first["losses"] and second["params"] == first["params"]
    assert first["stats"]["step_miss"] == second["stats"]["step_hit"] == 0  # (DTensors: torch's caches)
    assert first["mesh_copies"] == [True, True, True]  # pickle and deepcopy still give the same mesh


@pytest.mark.parametrize("mode", ["usr", "", "Workdir", "cache", None])
def test_bad_mode_is_one_clear_error(mode):
    with pytest.raises(ValueError, match="compile_cache=.*'user'.*'workdir'.*'off'.*path"):
        compile_cache.setup(mode, "runs/x")


def test_workdir_mode_needs_a_workdir():
    with pytest.raises(ValueError, match="workdir"):
        compile_cache.setup("workdir", None)


@pytest.fixture
def env(monkeypatch):
    """Restores TORCHINDUCTOR_CACHE_DIR (which `setup` sets) after the test."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/placeholder")
    return monkeypatch


def test_directories(env, tmp_path):
    run = tmp_path / "run" / "compile_cache" / ISA
    assert compile_cache.setup("workdir", tmp_path / "run") == run
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(run)
    assert run.is_dir()
    assert compile_cache.setup(str(tmp_path / "explicit")) == tmp_path / "explicit" / ISA
    assert compile_cache.setup(str(tmp_path / "explicit" / ISA)) == tmp_path / "explicit" / ISA  # not keyed twice

    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "from-env"))
    assert compile_cache.setup("user") == tmp_path / "from-env" / ISA  # a dir the user set is honored
    compile_cache.setup("workdir", tmp_path / "run")  # an earlier run in this process ...
    assert compile_cache.setup("user") == tmp_path / "from-env" / ISA  # ... does not leak into "user"
    env.delenv("TORCHINDUCTOR_CACHE_DIR")
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.setup("user") == tmp_path / "xdg" / "functrain" / "inductor" / ISA


def test_user_mode_is_the_per_user_directory_after_torch_wrote_its_default(tmp_path):
    """Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to torch's /tmp default when the user left
    it unset; "user" is still $XDG_CACHE_HOME/functrain/inductor then, and a user's value still wins."""
    code = (
        "import os, sys, torch._dynamo; from functrain.compiler import cache as compile_cache; "
        "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR')); print(compile_cache.setup('user'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    for user_dir, want in ((None, tmp_path / "xdg" / "functrain" / "inductor"), (tmp_path / "mine", tmp_path / "mine")):
        if user_dir is not None:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(user_dir)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        torch_wrote, got = out.stdout.strip().splitlines()[-2:]
        assert torch_wrote and Path(got) == want / Path(got).name, (torch_wrote, got)  # + the ISA key


def test_directories_are_keyed_by_the_cpu_isa(tmp_path):
    """Kernels compiled for one vector ISA are never served under another (torch's key omits it)."""
    code = "import sys; from functrain.compiler import cache as compile_cache; print(compile_cache.setup(sys.argv[1]))"
    dirs = {}
    for cap in ("avx2", "default"):
        env = dict(os.environ, PYTHONPATH=str(REPO), ATEN_CPU_CAPABILITY=cap)
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "c")], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        dirs[cap] = out.stdout.strip().splitlines()[-1]
    assert dirs == {"avx2": str(tmp_path / "c" / "avx2"), "default": str(tmp_path / "c" / "default")}


def test_isa_probe_runs_in_the_background_and_is_memoized(tmp_path):
    """`start_isa_probe` does inductor's vector-ISA probe in a thread, into the cache dir, once."""
    code = r"""
import json, sys
from functrain.compiler import cache as compile_cache
cache = compile_cache.setup(sys.argv[1])
from torch._inductor import cpu_vec_isa
before = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
thread = compile_cache.start_isa_probe()
thread.join(300)
print(json.dumps({"before": before, "alive": thread.is_alive(),
                  "memoized": cpu_vec_isa.valid_vec_isa_list.cache_info().currsize,
                  "programs": sorted(str(p.relative_to(cache)) for p in cache.rglob("*.so"))}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c")], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == 0 and not got["alive"]
    assert got["memoized"] == 1  # the answer is memoized: inductor's own call finds it, no second probe
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":  # a vector ISA: its test programs were built there
        assert got["programs"], got
