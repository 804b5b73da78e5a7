"""The lazily loaded packages (`functrain._lazy`): every public name their `if TYPE_CHECKING:` imports
state resolves, to the object those imports name, and importing them (or the config checks) loads no
torch."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys

import pytest

PACKAGES = [
    "functrain",
    "functrain.checkpoint",
    "functrain.eval",
    "functrain.interop",
    "functrain.main",
    "functrain.optim",
    "functrain.models.gpt",
    "functrain.models.llama",
    "functrain.step",
    "functrain.trainer",
]


def _run_static_imports(package) -> dict:
    """What the package's `if TYPE_CHECKING:` imports bind, run by Python itself (the reference)."""
    tree = ast.parse(inspect.getsource(package))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    namespace: dict = {}
    exec(compile(ast.Module(body=block.body, type_ignores=[]), package.__file__, "exec"), namespace)
    namespace.pop("__builtins__")
    return namespace


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_resolves_to_the_object_its_static_import_names(name):
    package = importlib.import_module(name)
    want = _run_static_imports(package)
    assert len(want) >= 5 and sorted(package.__all__) == sorted(want)
    for attr in package.__all__:
        assert getattr(package, attr) is want[attr], attr
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = package.no_such_name


def test_every_package_exports_only_names_it_has():
    """Every functrain package's `__all__`, lazy or eager (`functrain.parallel` imports its modules for what
    they register), names something the package has."""
    import pkgutil

    import functrain

    packages = ["functrain"] + [m.name for m in pkgutil.walk_packages(functrain.__path__, "functrain.") if m.ispkg]
    assert "functrain.parallel" in packages and len(packages) >= 10
    for name in packages:
        package = importlib.import_module(name)
        missing = [attr for attr in getattr(package, "__all__", ()) if not hasattr(package, attr)]
        assert not missing, (name, missing)


def test_the_top_level_names_are_the_documented_ones():
    import functrain
    from functrain import optim, state, step

    assert functrain.TrainState is state.TrainState and functrain.make_train_step is step.make_train_step
    assert functrain.optim is optim and optim.adamw is importlib.import_module("functrain.optim.aliases").adamw
    assert sorted(functrain.__all__) == sorted(
        [  # what a user composes (docs/layers.md)
            "checkpoint",
            "data",
            "grpo",
            "losses",
            "metric_names",
            "nn",
            "optim",
            "parallel",
            "preference",
            "rng",
            "step",
            "tree",
            "apply",
            "TrainState",
            "init_state",
            "params_of",
            "apply_gradients",
            "make_train_step",
            "make_eval_step",
            "update_step",
            "value_and_grad",
            "Task",
            "FunctrainError",
        ]
    )
    with pytest.raises(AttributeError, match="has no attribute 'get_batch'"):
        functrain.get_batch  # noqa: B018 - a name of the data package, reached as functrain.data.get_batch
    assert functrain.per_example is importlib.import_module("functrain.per_example")  # a submodule stays reachable


def test_importing_the_packages_and_the_config_checks_loads_no_torch():
    code = (
        "import sys, functrain, functrain.trainer.optimizer_checks, functrain.models.gpt.checks, "
        "functrain.models.llama.checks, functrain.trainer.defaults, functrain.config_checks\n"
        "print(sorted(m for m in ('torch', 'numpy', 'tensorstore') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_global_norm_of_dtensors_needs_functrain_parallel_and_is_then_the_mesh_wide_norm():
    """`import functrain` does not import `functrain.parallel`, which registers the mesh-wide DTensor
    norm with `functrain.tree` (tree sits below parallel and does not import it): DTensors made with
    torch alone get one clear error until it is imported, then the mesh-wide norm as a plain tensor."""
    code = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from functrain import tree
assert "functrain.parallel" not in sys.modules
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
xs = {"a": torch.arange(12.0).reshape(4, 3), "b": torch.ones(5)}
sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in xs.items()}
try:
    tree.global_norm(sharded)
except TypeError as exc:
    print("error:", str(exc).split(":")[-1].strip().replace(" ", "_"))
import functrain.parallel
norm = tree.global_norm(sharded)
want = torch.cat([v.flatten() for v in xs.values()]).norm()
print(type(norm).__name__, norm.dtype, bool(torch.equal(norm, want)))
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["error:", "import_functrain.parallel_first", "Tensor", "torch.float32", "True"], (
        proc.stdout
    )


def test_modules_have_one_name_each():
    """No import hook: a module is imported by its one name (functrain.trainer.loop, not functrain.loop)."""
    import functrain

    assert not any(type(f).__module__.startswith("functrain") for f in sys.meta_path)
    for old in ("functrain.loop", "functrain.remat", "functrain.memory"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    with pytest.raises(AttributeError):
        functrain.memory  # noqa: B018


def test_every_one_line_error_is_a_functrain_error_and_keeps_its_builtin():
    """The main program prints any `FunctrainError` as one line (no list of types there); each package's error
    is one, and still the builtin it always was."""
    import ast
    from pathlib import Path

    from functrain import FunctrainError
    from functrain.checkpoint import CheckpointError
    from functrain.compiler import GraphBreakError
    from functrain.config_checks import ConfigError
    from functrain.data import DataError
    from functrain.interop.hf import HFError
    from functrain.interop.safetensors import SafetensorsError
    from functrain.trainer.hooks import TrainingError
    from functrain.trainer.plot import PlotError

    for error, builtin in [
        (ConfigError, ValueError),
        (DataError, ValueError),
        (CheckpointError, ValueError),
        (HFError, ValueError),
        (SafetensorsError, ValueError),
        (TrainingError, RuntimeError),
        (GraphBreakError, RuntimeError),
        (PlotError, RuntimeError),
    ]:
        assert issubclass(error, FunctrainError) and issubclass(error, builtin), error
    tree = ast.parse((Path(__file__).resolve().parents[1] / "functrain" / "trainer" / "main.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    handled = [ast.unparse(h.type) for h in ast.walk(main) if isinstance(h, ast.ExceptHandler) and h.type is not None]
    calls = [ast.unparse(n.func) for n in ast.walk(main) if isinstance(n, ast.Call)]
    assert "FunctrainError" in handled and "isinstance" not in calls  # one except, no list of types
