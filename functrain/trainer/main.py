"""Command-line entry point: `python -m functrain.main --config=configs/gpt.py[:variant]`.

Internals: docs/internals.md "functrain.trainer.main".
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from functrain import config_checks

_DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "gpt.py")

_CONFIG = config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Config file, optionally with ':variant'.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config>[-<variant>]).")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", None, "Instead of training: write a checkpoint's params as a Hugging Face directory here."
)
_CONFIG_DUMP = flags.DEFINE_bool(
    "config_dump", False, "Instead of training: print the resolved config (file, variant and flags), checked, as JSON."
)
_EXPORT_FROM = flags.DEFINE_string(
    "export_from", None, "With --export_hf: a step directory, checkpoints directory or workdir (default: --workdir)."
)


def _say(line: str) -> None:
    """Writes `line` and its newline to stderr in one write (ranks sharing a pipe cannot split it)."""
    text = line + "\n"
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), text.encode(sys.stderr.encoding or "utf-8", "backslashreplace"))
    except (AttributeError, OSError, ValueError):  # a stderr without a descriptor (captured in tests)
        sys.stderr.write(text)
        sys.stderr.flush()


def _fail(message: str) -> None:
    """Prints one error line and exits with status 2."""
    _say(f"functrain: error: {message}")
    sys.exit(2)


def _explain_flag_error(exc: Exception, argv: list[str]) -> str:
    """One readable line for a flag-parsing failure."""
    text = str(exc).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a quoted message
        text = text[1:-1]
    if isinstance(exc, AttributeError):
        text = text.replace("\\'", "'").replace("\\n", " ")
        hint = re.search(r'Did you mean "(\w+)" instead of "(\w+)"', text)
        key = hint.group(2) if hint else (re.findall(r"(\w+)", text) or [""])[0]
        bad = next((a for a in argv if a.startswith("--config.") and key and key in a.split("=")[0]), None)
        msg = f"unknown config key {bad.split('=')[0] if bad else key!r}"
        if hint:
            msg += f" (did you mean {hint.group(1)!r}?)"
        return msg + "; the valid keys are in the config file's get_config()"
    if isinstance(exc, flags.UnrecognizedFlagError):
        return f"{text}; run with --helpfull to list the flags"
    if isinstance(exc, (SyntaxError, ImportError, OSError)):  # the config file itself
        return _explain_config_error(exc)
    if "Traceback (most recent call last)" in text:  # the config file's get_config raised: its last line
        flag = text.split(": Error whilst parsing")[0]
        return f"{flag}: {[ln for ln in text.splitlines() if ln.strip()][-1].strip()}"
    return text.splitlines()[0]


def _explain_config_error(exc: Exception) -> str:
    """One line for a config file that cannot be loaded (missing, not Python, raising)."""
    arg = next((a for a in sys.argv[1:] if a.startswith("--config=")), "--config")
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errno = next((ln for ln in lines if ln.startswith("[Errno")), None)  # e.g. no such file
    return f"cannot load {arg}: {errno or type(exc).__name__ + ': ' + (lines[-1] if lines else '')}"


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that turns every failure into one clear line."""
    try:
        return flags.FLAGS(argv)
    except Exception as exc:  # noqa: BLE001 - every flag error becomes one line
        _fail(_explain_flag_error(exc, argv))
    return []


def _default_workdir(config_arg: str) -> str:
    """runs/<config file stem>[-<variant>]."""
    path, _, variant = config_arg.partition(":")
    name = Path(path).stem + (f"-{variant}" if variant else "")
    return str(Path("runs") / name)


def train(config: Any, workdir: str | Path, *, print_fn: Callable[..., None] = print, hooks=()) -> dict:
    """Runs the job `config` describes, in this process: its model family's Task through the loop.

    Args:
      config: a run config (e.g. `configs/gpt.py`'s `get_config()`); `config.model.name` names the
        family (`functrain/models/<name>/task.py`).
      workdir: the run directory.
      print_fn: where the main process's console lines go.
      hooks: extra `functrain.trainer.loop.Hook`s.

    Returns:
      The loop's summary dict.

    Raises:
      ConfigError, TrainingError, CheckpointError, DataError: one line each.

    Example:
      >>> summary = train(gpt_config.get_config("tiny"), "runs/tiny")
    """
    t_program = time.perf_counter()
    check_config(config)  # every key, once, before the heavy modules load
    from functrain import parallel
    from functrain.trainer import loop, validate
    from functrain.trainer import optimizer as trainer_optimizer

    family = _family(config)
    _check_init_from(config, workdir, loop)
    try:  # before any data is prepared in it
        Path(workdir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise config_checks.ConfigError(
            f"workdir {workdir}: cannot be created ({exc.strerror or exc}); pass a writable --workdir"
        ) from None
    try:
        # torchrun env -> process group + mesh; plain python: none
        ctx = parallel.setup(config.mesh, timeout_s=config.dist_timeout_s or None)
    except ValueError as exc:
        raise config_checks.ConfigError(f"{exc}; fix --config.mesh.* or the number of processes") from None
    with ctx:
        loop.resolve_device(config, ctx)  # a device this torch lacks fails before any data is prepared
        task = family.build(config, ctx, workdir)
        _steps_from_epochs(config, task, validate)
        optimizer = trainer_optimizer.from_config(config.optim, config.steps)
        return loop.run(task, optimizer, config, workdir, ctx, hooks=hooks, print_fn=print_fn, t_program=t_program)


def _steps_from_epochs(config: Any, task, validate) -> None:
    """`config.steps` from `config.epochs` when it is set (the task knows its steps per epoch)."""
    epochs = config.epochs
    if not epochs:
        return
    per_epoch = task.data.steps_per_epoch
    if per_epoch is None:
        raise config_checks.ConfigError(
            f"epochs={epochs:g}: this data has no epochs (random windows of text); set "
            "--config.steps, or use supervised examples / --config.data.sampling=epochs"
        )
    with config.unlocked() if hasattr(config, "unlocked") else contextlib.nullcontext():
        config.steps = max(1, math.ceil(epochs * per_epoch))


def export_hf(
    config: Any,
    workdir: str | Path,
    out: str | Path,
    source: str | None = None,
    *,
    print_fn: Callable[..., None] = print,
) -> Path:
    """Writes the params of a checkpoint of the job `config` describes as a Hugging Face directory.

    Args:
      config: the run config the checkpoint was trained with.
      workdir: the run directory (its latest checkpoint is exported unless `source` is given).
      out: the directory to write.
      source: a step directory, checkpoints directory or workdir.
      print_fn: where the result line goes.

    Returns:
      The written directory.

    Raises:
      ConfigError: no committed checkpoint there, or a family without an export.

    Example:
      >>> export_hf(llama_config.get_config("tiny"), "runs/llama-tiny", "runs/llama-tiny/hf-500",
      ...           "runs/llama-tiny/checkpoints/500")
    """
    check_config(config, mesh=_launched())  # every key, once, before the heavy modules load
    from functrain import checkpoint as ckpt_lib
    from functrain import parallel
    from functrain.trainer import exports, loop

    family = _family(config)
    lora = bool(config.lora.rank)
    exports.check_targets(exports.targets(Path(out), lora=lora), flag=f"--export_hf={out}")
    step_dir = loop.checkpoint_path(source or str(workdir), key="--export_from")
    # One process reads the params whole, whatever mesh trained them: the training run's mesh flags
    # only count under torchrun.
    mesh = config.mesh if _launched() else None
    with parallel.setup(mesh, timeout_s=config.dist_timeout_s or None) as ctx:
        task = family.build(config, ctx, workdir)
        if task.export is None:
            raise config_checks.ConfigError(f"model family {config.model.name!r} has no export format")
        params = ckpt_lib.restore(step_dir, {"params": ckpt_lib.metadata_tree(step_dir)["params"]}).result()["params"]
        if task.frozen is not None:  # a LoRA checkpoint holds the adapters: the base is made again, and checked
            from functrain.trainer import frozen as frozen_lib

            saved = ckpt_lib.read_custom_metadata(step_dir).get("functrain", {}).get(frozen_lib.KEY)
            init_from = config.checkpoint.init_from
            base = frozen_lib.base_for_export(
                task, config, step_dir, ctx.device, saved, loop.checkpoint_path(init_from) if init_from else None
            )
            params = {**base, **params}
        path, unchecked = exports.write(task, params, Path(out))
    print_fn(f"exported {step_dir} to {path}" + (f" ({unchecked})" if unchecked else ", checked against transformers"))
    return Path(path)


def _launched() -> bool:
    """Whether torchrun started this process (as `parallel.setup` decides)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def check_config(config: Any, mesh: bool = True) -> None:
    """Checks every key of a run config, once: the loop's, the optimizer's and its model family's
    (`functrain.trainer.validate.LOOP_CHECKS`, `functrain.trainer.optimizer_checks`, `models/<name>/checks.py`) and,
    with `mesh`, the mesh against torchrun's world size and the batch against the mesh. torch-free:
    a bad value costs ~0.4 s. `train` calls it; `loop.run` and a family's `build` take a checked
    config and do not check it again.

    Args:
      config: the run config.
      mesh: also check the mesh and the batch against the world size.

    Returns:
      None.

    Raises:
      ConfigError: the first bad value (one line naming the key, the valid range and the flag).

    Example:
      >>> check_config(gpt_config.get_config("tiny"))
    """
    from functrain.trainer import validate
    from functrain.trainer.optimizer_checks import CHECKS as optim_checks

    family = _family(config, "checks")
    config_checks.check_all(config, [*validate.LOOP_CHECKS, *optim_checks, *family.CHECKS])
    validate.check_cuda_graphs(config)
    dist = sys.modules.get("torch.distributed")
    if not mesh or (dist is not None and dist.is_available() and dist.is_initialized()):
        return  # no mesh, or a caller's own process group: parallel.setup checks the mesh against it
    world = int(os.environ["WORLD_SIZE"]) if _launched() else 1
    try:
        shape = config_checks.mesh_shape(config.mesh, world)
    except ValueError as exc:
        raise config_checks.ConfigError(f"{exc}; fix --config.mesh.* or the number of processes") from None
    pp = config.mesh.pp
    size = {k: config_checks.get(config, key) for k, key in family.SIZES.items()}  # (0: not this family's key)
    config_checks.check_pipeline(pp, config.accum_steps, size.get("n_layer", 0))
    micro = ("pp.microbatches", config.pp.microbatches) if pp > 1 else ("accum_steps", config.accum_steps)
    config_checks.check_batch(config.batch_size, micro[1], config_checks.dp_world(shape) if world > 1 else 1, micro[0])
    config_checks.check_context(size.get("block_size", 0), shape["cp"])
    if config.device == "cpu" or (config.device == "auto" and not _has_gpu()):
        rows = config.batch_size // micro[1] // (config_checks.dp_world(shape) if world > 1 else 1)
        config_checks.check_attention_fits(size.get("block_size", 0), size.get("n_head", 0), rows, shape["cp"])


def _has_gpu() -> bool:
    """Whether this host has an NVIDIA device (torch-free: its device node)."""
    return os.path.exists("/dev/nvidiactl")


def _check_init_from(config: Any, workdir: str | Path, loop) -> None:
    """A `checkpoint.init_from` naming no checkpoint stops before any data or model is made (a run
    that resumes from its own workdir does not read it)."""
    from functrain.trainer.validate import ConfigError

    if not config.checkpoint.init_from:
        return
    try:
        loop.checkpoint_path(str(workdir))
        return  # resuming
    except ConfigError:
        loop.checkpoint_path(config.checkpoint.init_from)


def _family(config: Any, module: str = "task"):
    """The `task` (or `checks`) module of the model family `config.model.name`."""

    name = config.model.name if "name" in config.model else ""
    try:
        if isinstance(name, str) and name.isidentifier():
            return importlib.import_module(f"functrain.models.{name}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name not in (f"functrain.models.{name}", f"functrain.models.{name}.{module}"):
            raise  # a module the family imports is missing, not the family
    families = Path(__file__).resolve().parents[1] / "models"
    known = sorted(p.name for p in families.iterdir() if (p / "task.py").exists() and (p / "checks.py").exists())
    raise config_checks.fail("model.name", name, "one of " + ", ".join(repr(k) for k in known))


def main(argv: list[str]) -> None:
    """Loads the config and runs `train`."""
    del argv
    from functrain.errors import FunctrainError

    try:
        config = _CONFIG.value
        config.keys()  # a file that failed to load is an object that raises on first use
    except Exception as exc:  # noqa: BLE001 - a config file that fails to load
        _fail(_explain_config_error(exc))
    workdir = _WORKDIR.value or _default_workdir(flags.FLAGS["config"].serialize().split("=", 1)[-1])
    try:
        if _CONFIG_DUMP.value:
            check_config(config, mesh=False)
            print(config.to_json_best_effort(indent=2, sort_keys=True))
        elif _EXPORT_HF.value:
            export_hf(config, workdir, _EXPORT_HF.value, _EXPORT_FROM.value)
        else:
            train(config, workdir)
    except FunctrainError as exc:  # every one-line error (config, data, checkpoint, export, training, graph break)
        _fail(str(exc))
    except KeyboardInterrupt:  # a second Ctrl-C while training, or one before the loop started
        _say("functrain: interrupted; the same command resumes from the last committed checkpoint")
        sys.exit(130)


def run() -> None:
    """Console-script entry point."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
