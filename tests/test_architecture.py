"""The layout's rules, checked on the source: the trainer knows no model, only parallel/ knows
DTensor, only compiler/ touches torch's compiler internals, no import circle (function-local and
importlib imports counted), no patch of torch and no attribute hung on a function; and the contracts
that replaced strings and attributes (the loss's result and type, the optimizer's report, hooks with
an `every`)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from functrain import init_state, make_train_step, optim
from functrain import step as step_lib
from functrain import task as task_lib
from functrain.trainer import optimizer as trainer_optimizer

PKG = Path(__file__).resolve().parent.parent / "functrain"


def _imports(path: Path) -> set[str]:
    """Every module a source file imports, at any depth (absolute names; relative imports resolved;
    `importlib.import_module` of a constant string included)."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value)
    return out


def _modules():
    """(dotted name, path) of every functrain module."""
    for path in sorted(PKG.rglob("*.py")):
        yield ".".join(path.relative_to(PKG.parent).with_suffix("").parts), path


def test_only_main_imports_a_model_family_outside_models():
    offenders = [
        name
        for name, path in _modules()
        if not name.startswith("functrain.models")
        and name not in ("functrain.main", "functrain.trainer.main")
        and any(i.startswith("functrain.models.") or i == "functrain.models" for i in _imports(path))
    ]
    assert offenders == []


def test_only_parallel_and_storage_know_dtensor():
    """DTensor logic lives in parallel/; the storage formats (checkpoints, safetensors) read and
    write shards as they are laid out; the compile cache's key for a DeviceMesh is the compiler's."""
    offenders = [
        name
        for name, path in _modules()
        if not name.startswith(("functrain.parallel", "functrain.checkpoint", "functrain.interop"))
        and name != "functrain.compiler.mesh_key"
        and any(i.startswith("torch.distributed") for i in _imports(path))
    ]
    assert offenders == []
    code = ast.parse((PKG / "step" / "steps.py").read_text())
    names = {n.id for n in ast.walk(code) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(code) if isinstance(n, ast.Attribute)
    }
    assert not names & {"DTensor", "Spmd", "spmd", "_is_dtensor", "is_dtensor"}  # one body, via the Layout
    assert not any(i.startswith("functrain.parallel") for i in _imports(PKG / "tree.py"))


_PRIVATE_COMPILER = re.compile(r"torch\._(dynamo|inductor|functorch|higher_order_ops)\b")


# The layers, top down (docs/layers.md): a module may import its own layer and the ones below.
_LAYERS = [
    ("trainer", ("functrain.trainer", "functrain.main")),
    ("families", ("functrain.models",)),
    (
        "library",
        (
            "functrain.state",
            "functrain.step",
            "functrain.functional",
            "functrain.losses",
            "functrain.task",
            "functrain.per_example",
            "functrain.population",
            "functrain.optim",
            "functrain.parallel",
            "functrain.checkpoint",
            "functrain.data",
            "functrain.eval",
            "functrain.generation",
            "functrain.interop",
            "functrain.nn",
            "functrain.compiler",
            "functrain",
        ),
    ),
    (
        "base",
        (
            "functrain.tree",
            "functrain.rng",
            "functrain.ops",
            "functrain.config_checks",
            "functrain.metric_names",
            "functrain.errors",
            "functrain._lazy",
        ),
    ),
]


def _layer(name: str) -> int:
    """The index in _LAYERS of the most specific prefix that names `name` (0: the top)."""
    best = max(
        (
            (len(p), i)
            for i, (_, prefixes) in enumerate(_LAYERS)
            for p in prefixes
            if name == p or name.startswith(p + ".")
        ),
        default=None,
    )
    assert best is not None, f"{name} is in no layer of docs/layers.md"
    return best[1]


def test_imports_point_down_the_layers_and_the_library_never_imports_the_trainer():
    upward = []
    for name, path in _modules():
        name = name.removesuffix(".__init__")
        me = _layer(name)
        for imported in _imports(path):
            if imported.startswith("functrain.") and _layer(imported) < me:
                upward.append(f"{name} ({_LAYERS[me][0]}) imports {imported} ({_LAYERS[_layer(imported)][0]})")
    assert sorted(set(upward)) == []


def test_only_the_compiler_package_touches_torch_compiler_internals():
    """No import, attribute or name of torch._dynamo / _inductor / _functorch / _higher_order_ops in
    code (docstrings included) outside functrain/compiler/."""
    offenders = []
    for name, path in _modules():
        if name.startswith("functrain.compiler"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _PRIVATE_COMPILER.search(line.split("#", 1)[0]):
                offenders.append(f"{name}:{i}")
    assert offenders == []


def test_no_torch_patch_and_no_attribute_hung_on_a_function():
    """Nothing assigns into torch's modules (a process-wide change), and no `type: ignore[attr-defined]`
    marks an attribute set on a function or a foreign object."""
    patch = re.compile(r"^\s*torch(\.\w+)+\s*=[^=]|setattr\(\s*torch\b|c10d\.\w+\s*=[^=]")
    offenders = [
        f"{name}:{i}"
        for name, path in _modules()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if (patch.search(line) and ".config." not in line)  # (compiler settings are settings)
        or "type: ignore[attr-defined]" in line
    ]
    assert offenders == []


def test_no_import_circle_counting_local_and_importlib_imports():
    """The static import graph among functrain modules (imports at any depth, importlib included;
    a module's own packages are not edges) has no circle."""
    names = {name.removesuffix(".__init__"): path for name, path in _modules()}

    def targets(name, path):
        out = set()
        for imported in _imports(path):
            parts = imported.split(".")
            for k in range(len(parts), 0, -1):
                t = ".".join(parts[:k])
                if t in names:
                    if t != name and not name.startswith(t + "."):
                        out.add(t)
                    break
        return out

    edges = {n: targets(n, p) for n, p in names.items()}
    state: dict = {}

    def visit(n, trail):
        state[n] = "open"
        for t in sorted(edges[n]):
            if state.get(t) == "open":
                raise AssertionError("import circle: " + " -> ".join(trail[trail.index(t) :] + [t]))
            if t not in state:
                visit(t, trail + [t])
        state[n] = "done"

    for n in sorted(names):
        if n not in state:
            visit(n, [n])


def test_no_private_name_crosses_modules():
    """A name with a leading underscore is its module's own: what modules share has a public name (a
    package's private submodule, `from . import _dist`, is its package's)."""
    crossings = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        pkg = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("functrain")):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                own_package = base.rsplit(".", 1)[-1].startswith("_")  # e.g. checkpoint._dist, functrain._lazy
                crossings += [
                    f"{path.relative_to(PKG.parent)}:{node.lineno} {base}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                    and not a.name.startswith("__")
                    and not own_package
                    and not (base == pkg and PKG.parent.joinpath(*base.split("."), f"{a.name}.py").exists())
                ]
    assert not crossings, crossings


_NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}


def test_no_private_attribute_of_another_module_is_read():
    """Nor reached as an attribute: `tree_lib._rebuild` or `optim_base._MASK_LOG` from another module is a private
    name crossing (a NamedTuple's own API, `TrainState._fields`, is public)."""
    crossings = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        bound = set()  # names this file binds to functrain's modules and classes by import
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("functrain")}
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("functrain")):
                bound |= {a.asname or a.name for a in node.names}
        crossings += [
            f"{path.relative_to(PKG.parent)}:{node.lineno} {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in _NAMEDTUPLE_API
        ]
    assert not crossings, crossings


# The loop's hook names are its documented API (`loop.every(n, fn)`, README "Features"): the one exception.
_REEXPORTS = {"trainer/loop.py": {"Hook", "StepInfo", "TrainingError", "checkpoint_path", "every"}}


def test_a_module_exports_only_names_it_defines():
    """A module's `__all__` names what it defines; a package's `__init__` re-exports each public name once, from
    the module that defines it (no module-level re-export a reader must follow)."""
    found = {}
    for path in PKG.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        imported, exported = set(), set()
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                exported = {e.value for e in getattr(node.value, "elts", [])}
        name = str(path.relative_to(PKG))
        reexported = (exported & imported) - _REEXPORTS.get(name, set())
        if reexported:
            found[name] = sorted(reexported)
    assert not found, found


def test_no_package_name_is_both_a_function_and_a_module():
    """A package's public name that is also one of its modules' names must be that module: importing the
    module (`import functrain.data.x`) sets the package attribute `x` to it, hiding a function `x`."""
    clashes = []
    for init in PKG.rglob("__init__.py"):
        package = ".".join(("functrain",) + init.parent.relative_to(PKG).parts)
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != package:
                for alias in node.names:
                    name = alias.asname or alias.name
                    if (init.parent / f"{name}.py").exists() or (init.parent / name).is_dir():
                        clashes.append(f"{package}.{name} is a module and {node.module}.{alias.name}")
    assert not clashes, clashes


def test_no_import_cycles():
    """Each module imports in a fresh interpreter on its own (a cycle fails on one of them)."""
    code = (
        "import importlib, sys, json\nbad = []\nfor m in json.loads(sys.argv[1]):\n"
        "    try:\n        importlib.import_module(m)\n    except Exception as e:\n        bad.append((m, repr(e)))\n"
        "    for k in [k for k in sys.modules if k.startswith('functrain')]:\n        del sys.modules[k]\n"
        "print(json.dumps(bad))"
    )
    names = [n for n, _ in _modules() if not n.endswith("__main__")]
    out = subprocess.run([sys.executable, "-c", code, json.dumps(names)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_loop_never_asks_whether_it_runs_a_pipeline():
    # the route (one process or a pipeline rank) is chosen in trainer/route.py; the loop only runs it
    source = (PKG / "trainer" / "loop.py").read_text()
    assert "functrain.trainer.route" in _imports(PKG / "trainer" / "loop.py")
    for word in ("pp_world", "pipeline", "pp_group"):
        assert word not in source, f"trainer/loop.py mentions {word!r}: put the difference in trainer/route.py"


def test_a_pipeline_rank_runs_the_staged_engine_not_a_copy_of_it():
    # no loop over blocks and no vjp of a block in parallel/pipeline.py: its ranks call the engine's halves
    tree = ast.parse((PKG / "parallel" / "pipeline.py").read_text())
    running = [
        n for n in tree.body if getattr(n, "name", "") in ("_Rank", "make_pipeline_step", "make_pipeline_eval_step")
    ]
    assert len(running) == 3
    calls = {
        n.func.attr
        for r in running
        for n in ast.walk(r)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert {"forward_blocks", "backward_blocks"} <= calls
    for node in (n for r in running for n in ast.walk(r)):
        if isinstance(node, ast.For):
            assert "blocks" not in ast.unparse(node.iter), f"pipeline.py:{node.lineno} loops over blocks itself"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "vjp":
            assert "block" not in ast.unparse(node), f"pipeline.py:{node.lineno} differentiates a block itself"


def test_the_step_tells_a_staged_loss_by_its_type():
    """A plain function with the staged loss's method names is an ordinary loss: the step
    differentiates it with torch.func (no attribute probing), and a StagedLoss uses its own route."""
    from functrain.step import staged as remat

    def plain(p, b, k):
        return (p["w"] ** 2).sum()

    plain.value_and_grad = lambda *a, **k: (_ for _ in ()).throw(AssertionError("probed by attribute"))
    loss, _, grads = step_lib.value_and_grad(plain, {"w": torch.ones(2)}, None, None)
    assert torch.equal(grads["w"], 2 * torch.ones(2))
    embed = remat.Stage(("w",), lambda p, batch, key: p["w"])
    head = remat.Stage((), lambda p, h, batch, key: (h**2).sum())
    staged = remat.staged_loss(embed, [], head, policy="none")
    assert isinstance(staged, remat.StagedLoss)
    loss2, _, grads2 = step_lib.value_and_grad(staged, {"w": torch.ones(2)}, None, None)
    assert torch.equal(loss2, loss) and torch.equal(grads2["w"], grads["w"])
    with pytest.raises(ValueError, match="compile='blocks'.*staged loss"):
        make_train_step(plain, optim.sgd(0.1), compile="blocks")


def test_a_loss_returns_a_scalar_or_loss_and_a_dict():
    from functrain.nn.model_state import loss_and_aux

    w = torch.ones(3)
    assert loss_and_aux(w.sum())[1] == {}
    loss, aux = loss_and_aux((w.sum(), {"n": w[0]}))
    assert set(aux) == {"n"}
    with pytest.raises(TypeError, match=r"scalar tensor or \(loss, aux dict\), got a tuple of \(Tensor, Tensor\)"):
        loss_and_aux((w.sum(), w[0]))


def test_the_learning_rate_is_what_the_optimizer_reports():
    """A custom schedule transform reports its rate through `report`; nothing scans state types."""

    def my_scaled_sgd(rate):
        def init(params):
            return {"count": torch.zeros((), dtype=torch.int64)}

        def update(updates, state, params=None):
            lr = rate / (1.0 + state["count"].float())
            return {k: -lr * u for k, u in updates.items()}, {"count": state["count"] + 1, "lr": lr}

        return optim.Transform(init, update, optim.Traits(report=lambda state: {"lr": state["lr"]}))

    opt = my_scaled_sgd(0.5)
    # `init` has no "lr" yet: fill it so the state keeps one structure from step to step.
    state = init_state(
        {"w": torch.ones(2)},
        optim.Transform(
            lambda p: {"count": torch.zeros((), dtype=torch.int64), "lr": torch.zeros(())}, opt.update, opt.traits
        ),
    )
    step = make_train_step(lambda p, b, k: (p["w"] ** 2).sum(), opt, compile=False)
    lrs = []
    for _ in range(3):
        state, m = step(state, None)
        lrs.append(float(m["lr"]))
    assert lrs == pytest.approx([0.5, 0.25, 0.5 / 3])


def _tiny_config(tmp_path):
    """configs/gpt.py's tiny variant, checkpoints off, its data cache under `tmp_path`."""
    spec = importlib.util.spec_from_file_location("gpt_config", PKG.parent / "configs" / "gpt.py")
    gpt_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt_config)
    c = gpt_config.get_config("tiny")
    c.checkpoint.enabled = False
    c.data.cache_dir = str(tmp_path / "data")
    return c


def test_hooks_run_on_their_steps_and_at_the_end(tmp_path):
    from functrain import parallel
    from functrain.trainer import loop

    c = _tiny_config(tmp_path)
    c.steps, c.compile, c.log_every, c.eval_every, c.tensorboard = 7, False, 100, 100, False
    c.sample.max_new_tokens = 2
    seen = []
    hooks = [
        loop.every(3, lambda info: seen.append(("every3", info.step, info.final))),
        loop.every(5, lambda info: seen.append(("every5", info.step, info.final)), at_end=False),
    ]
    from functrain.models.gpt import task as gpt_task  # a test may import a model family

    with parallel.setup(c.mesh) as ctx:
        t = gpt_task.build(c, ctx, tmp_path / "run")
        assert isinstance(t, task_lib.Task)
        loop.run(
            t,
            trainer_optimizer.from_config(c.optim, c.steps),
            c,
            tmp_path / "run",
            ctx,
            hooks=hooks,
            print_fn=lambda *a: None,
        )
    assert seen == [("every3", 3, False), ("every5", 5, False), ("every3", 6, False), ("every3", 7, True)]


def test_gc_is_off_during_training_and_collects_every_n_steps_on_schedule(tmp_path):
    """Automatic collection is off while the loop runs; the young generations are collected exactly
    every `gc_every` steps (the same steps on every rank) and automatic collection is back after."""
    import gc

    from functrain import parallel
    from functrain.models.gpt import task as gpt_task
    from functrain.trainer import loop

    c = _tiny_config(tmp_path)
    c.steps, c.compile, c.log_every, c.eval_every, c.tensorboard, c.gc_every = 9, False, 100, 100, False, 3
    c.sample.max_new_tokens = 2
    seen = []

    def record(info):
        seen.append((info.step, gc.isenabled(), gc.get_stats()[1]["collections"]))

    assert gc.isenabled()
    with parallel.setup(c.mesh) as ctx:
        t = gpt_task.build(c, ctx, tmp_path / "run")
        loop.run(
            t,
            trainer_optimizer.from_config(c.optim, c.steps),
            c,
            tmp_path / "run",
            ctx,
            hooks=[loop.every(1, record, at_end=False)],
            print_fn=lambda *a: None,
        )
    assert gc.isenabled()
    assert [s for s, _, _ in seen] == list(range(1, 10))
    assert not any(enabled for _, enabled, _ in seen)
    counts = [n for _, _, n in seen]
    collected_at = [s for (s, _, n), prev in zip(seen[1:], counts) if n != prev]
    # the gc hook runs before user hooks: step 3's collection shows in step 3's record
    assert collected_at in ([3, 6, 9], [4, 7]), seen
    assert all(b - a == 1 for a, b in zip(counts, counts[1:]) if b != a), counts  # one collection each


def test_the_mfu_denominator_is_measured_before_the_isa_probe_starts(tmp_path, monkeypatch):
    """The loop times its 2048^2 matmul (the MFU denominator) before it starts the ISA probe's
    background g++ runs: measured beside them on 2 cores, the peak came out low and a run printed an
    MFU of 107.7%. The run is stopped where the probe would start (nothing is compiled)."""
    from functrain import parallel
    from functrain.compiler import cache as compile_cache
    from functrain.models.gpt import task as gpt_task
    from functrain.trainer import loop, metrics

    class Stop(Exception):
        pass

    calls = []

    def probe():
        calls.append("probe")
        raise Stop

    monkeypatch.setattr(compile_cache, "setup", lambda mode, workdir=None: tmp_path / "cache")  # no global change
    monkeypatch.setattr(compile_cache, "start_isa_probe", probe)
    monkeypatch.setattr(metrics, "measure_peak_flops", lambda device, *a, **k: calls.append("peak") or 1e11)
    c = _tiny_config(tmp_path)
    c.steps, c.compile, c.tensorboard, c.host_memory = 3, True, False, "default"
    with parallel.setup(c.mesh) as ctx:
        t = gpt_task.build(c, ctx, tmp_path / "run")
        with pytest.raises(Stop):
            loop.run(
                t, trainer_optimizer.from_config(c.optim, c.steps), c, tmp_path / "run", ctx, print_fn=lambda *a: None
            )
    assert calls == ["peak", "probe"]


def test_the_mfu_denominator_is_the_best_2048_cubed_matmul_rate_and_takes_a_device_name(monkeypatch):
    """measure_peak_flops("cpu") (a name, as users write it; it and peak_flops once demanded a
    torch.device) times a 2048^2 matmul and keeps the best rate: on a clock that ticks 1 s a reading,
    2 * 2048^3 FLOP/s. A CPU has no data-sheet peak."""
    import itertools
    import time

    from functrain.trainer import metrics

    clock = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    assert metrics.measure_peak_flops("cpu", seconds=2.5) == 2 * 2048**3
    assert metrics.peak_flops("cpu") is None


def test_the_config_is_checked_once(tmp_path, monkeypatch):
    """`main.check_config` checks every key; a family's `build` and `loop.run` take that config and
    do not run the key checks again."""
    from functrain import config_checks, parallel
    from functrain.models.gpt import task as gpt_task  # a test may import a model family
    from functrain.trainer import loop, main

    c = _tiny_config(tmp_path)
    c.steps, c.compile, c.log_every, c.eval_every, c.tensorboard = 2, False, 100, 100, False
    c.sample.max_new_tokens = 2
    calls = []
    real = config_checks.check_all
    monkeypatch.setattr(
        config_checks, "check_all", lambda config, checks: calls.append(len(checks)) or real(config, checks)
    )
    main.check_config(c, mesh=False)
    assert len(calls) == 1 and calls[0] > 40  # every key of the loop, the optimizer and the family
    with parallel.setup(c.mesh) as ctx:
        t = gpt_task.build(c, ctx, tmp_path / "run")
        loop.run(t, trainer_optimizer.from_config(c.optim, c.steps), c, tmp_path / "run", ctx, print_fn=lambda *a: None)
    assert len(calls) == 1


def test_an_mfu_measured_on_a_busy_machine_never_passes_100_percent():
    """The peak probed while other processes load every core measures low; windows that then compute
    at the machine's full rate still report at most 100% (the window raises the peak), and the probes
    after each window keep the best rate."""
    import os
    import subprocess
    import sys
    import time

    import torch

    from functrain.trainer import metrics

    burn = "import time\nt = time.time()\nwhile time.time() - t < 30: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.5)
        busy = metrics.measure_peak_flops("cpu", seconds=0.3)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    n = 1024
    a = torch.randn(n, n)
    tp = metrics.Throughput(
        tokens_per_step=1,
        flops_per_token=2 * n**3,
        peak_flops=busy / 4,
        total_steps=100,
        probe=lambda: metrics.measure_peak_flops("cpu", seconds=0.1),
    )
    tp.start(0)
    reports = []
    for window in range(3):
        for _ in range(5):
            _ = a @ a  # one "step": 2 n^3 FLOPs
        reports.append(tp.report(5 * (window + 1)))
    assert all(0 < r["mfu"] <= 1.0 for r in reports), reports
    assert tp.peak_flops >= busy  # the probes after the load replaced the low reading
