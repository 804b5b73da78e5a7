"""Compiled steps saved whole: a warm start loads the step's graph and kernels without Dynamo's trace.

A step compiled by `maybe_compile` under `cache.setup` (the main job's default) is compiled at its
first call with torch's `aot_compile` and written to `<cache dir>/steps/<name>-<key>-<n>.pt2step`;
the next process with the same key loads it and skips Dynamo, AOTAutograd and inductor. The key is
a digest of what the graph is built from that Dynamo's saved guards do not check: torch, Python and
the compiler's configs, and the step's functions, modules, globals and argument structure
(`fingerprint`). At load, the file's traced sources must equal the modules on disk and its guards
(the values the trace read, the tensors' shapes) must pass the arguments; otherwise the step is
compiled again.

Internals: docs/internals.md "functrain.compiler.saved_steps".

Example:
    >>> from functrain.compiler import cache, saved_steps
    >>> cache.setup("user")
    >>> step = compiler.maybe_compile(step_fn, True, None)  # saved at its first call, loaded by the next process
    >>> saved_steps.stats()
    {'hit': 0, 'miss': 1}
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import inspect
import io
import pickle
import re
import sys
import types
import uuid
import warnings
from pathlib import Path
from typing import Any

import optree
import torch

__all__ = ["SavedStep", "fingerprint", "stats", "usable"]

_SUFFIX = ".pt2step"


def usable(compiled: Any, options: dict | None, args: Any) -> bool:
    """Whether a step compiled as `compiled` with `options` can be saved whole for `args`.

    It can when torch's caches are on, the backend is inductor without CUDA graphs, torch offers
    `aot_compile`, and no argument is a DTensor (a sharded step's graph is keyed by its mesh: those
    use torch's own caches).

    Args:
      compiled: the `torch.compile`d function.
      options: the keyword arguments it was compiled with.
      args: the step's first arguments.

    Returns:
      True when `SavedStep` may compile and load this step.

    Example:
      >>> usable(torch.compile(fn), None, (state, batch))
      True
    """
    opts = options or {}
    inductor = opts.get("options") or {}
    return (
        not torch._inductor.config.force_disable_caches
        and opts.get("backend", "inductor") == "inductor"
        and not inductor.get("triton.cudagraphs")
        and callable(getattr(compiled, "aot_compile", None))
        and not any(_is_dtensor(x) for x in optree.tree_leaves(args, none_is_leaf=False))
    )


def stats() -> dict[str, int]:
    """This process's saved steps so far: {"hit": loaded from disk, "miss": compiled and saved}.

    Returns:
      The two counts (cumulative since the process started).

    Example:
      >>> stats()
      {'hit': 1, 'miss': 0}
    """
    from torch._dynamo.utils import counters

    return {"hit": int(counters["functrain"]["saved_step_hit"]), "miss": int(counters["functrain"]["saved_step_miss"])}


class SavedStep:
    """A step function that runs a compiled graph saved on disk, compiling and saving it on a miss.

    Each distinct argument structure gets its own entry (as Dynamo's recompiles would); a call runs
    the first entry whose guards pass. On disk, a key holds up to 8 entries (values that only the
    guards tell apart), the newest first.

    Args:
      compile_fn: `lambda guard_filter_fn: torch.compile(...)` of the step, with that guard filter.
      fn: the function being compiled (its closure is walked for the key; the loaded graph calls it).
      options: the compile options (part of the key).
      name: a readable prefix of the saved file's name.
      directory: where saved steps live.
      before_load: called before a saved file is loaded (`cache.wait_for_isa_probe`: the kernels'
        keys hold the vector ISA's flags, which a load beside the running probe got wrong).

    Example:
      >>> step = SavedStep(lambda f: compiler.graph(fn, {"options": {"guard_filter_fn": f}}), fn, None, "step", d)
    """

    def __init__(self, compile_fn, fn, options: dict | None, name: str, directory: Path, before_load=lambda: None):
        self._compile_fn, self._fn, self._options, self._before_load = compile_fn, fn, options, before_load
        self._name, self._dir = re.sub(r"[^A-Za-z0-9_.-]", "_", name), directory
        self._entries: list[Any] = []

    def __call__(self, *args):
        for entry in self._entries:
            if entry.guard_check(*args):
                return entry(*args)
        entry = self._load_or_compile(args)
        self._entries.append(entry)
        return entry(*args)

    def _load_or_compile(self, args: tuple):
        """The entry for `args`: a saved one that loads and passes, else one compiled now and saved."""
        from torch._dynamo.utils import counters

        stem = f"{self._name}-{_key(self._fn, self._options, args)[:40]}-"
        saved = sorted(self._dir.glob(f"{stem}*{_SUFFIX}"), key=_mtime, reverse=True)
        if saved:  # loading keys the kernels by the vector ISA's flags: not while the probe still runs beside it
            self._before_load()
        for path in saved:  # (one key, several entries: values the guards tell apart, as Dynamo's recompiles)
            entry = _load(path, self._fn, args)
            if entry is not None:
                counters["functrain"]["saved_step_hit"] += 1
                return entry
        counters["functrain"]["saved_step_miss"] += 1
        try:
            entry = self._compile_fn(_serializable_guards).aot_compile((args, {}))
        except (TypeError, torch._dynamo.exc.PackageError) as exc:  # guards torch cannot write down
            warnings.warn(f"functrain: note: the compiled step {self._name} is not saved whole ({exc})", stacklevel=3)
            return _Unsaved(self._compile_fn(None))
        entry.disable_guard_check()  # (checked in __call__)
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            path = self._dir / f"{stem}{uuid.uuid4().hex[:12]}{_SUFFIX}"
            entry.save_compiled_function(str(path), _closure(self._fn))
        except (OSError, RuntimeError, pickle.PicklingError, TypeError, AttributeError) as exc:
            # (the step runs as compiled; only the next process's warm start is lost)
            warnings.warn(f"functrain: note: the compiled step {self._name} is not saved whole ({exc})", stacklevel=3)
            return entry
        for stale in saved[_ENTRIES - 1 :]:  # the oldest go
            stale.unlink(missing_ok=True)
        return entry


_ENTRIES = 8  # saved entries kept per key (Dynamo's own recompile limit)


class _Unsaved:
    """A step compiled the plain way (Dynamo's own guards and caches), in the place of an entry that could not be
    saved."""

    def __init__(self, compiled):
        self._compiled = compiled

    def guard_check(self, *args) -> bool:
        """True: Dynamo's guards, checked at each call, recompile what they do not pass."""
        return True

    def __call__(self, *args):
        return self._compiled(*args)


def _mtime(path: Path) -> float:
    """`path`'s modification time (0 when it is gone)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _load(path: Path, fn, args: tuple):
    """The saved step at `path` if it loads, its traced sources are unchanged and its guards pass `args`; else None."""
    from torch._guards import TracingContext, tracing

    try:
        data = path.read_bytes()
        # torch 2.13: unpickling a guard on an imported module installs it into the current trace
        with tracing(TracingContext(None)):
            entry: Any = torch.compiler.load_compiled_function(io.BytesIO(data), external_data=_closure(fn))
    except Exception:  # another torch or Python, a truncated file: compiled again, saved anew
        return None
    if not _sources_unchanged(entry.source_info()) or not entry.guard_check(*args):
        return None
    entry.disable_guard_check()  # (checked in SavedStep.__call__)
    return entry


def _closure(fn) -> dict[str, Any]:
    """`fn`'s closure cells' contents by name: saved as references, given back live at load."""
    return {f"closure_{i}": cell.cell_contents for i, cell in enumerate(fn.__closure__ or ())}


def _sources_unchanged(source_info) -> bool:
    """Whether every module the saved step traced still has the source it had when compiled."""
    contents = {(src.module, src.content) for src in source_info.inlined_sources}  # (one per traced function)
    for name, content in contents:
        try:
            if inspect.getsource(importlib.import_module(name)) != content:
                return False
        except (ImportError, OSError, TypeError):
            return False
    return True


def _serializable_guards(entries) -> list[bool]:
    """Dynamo's guards a saved step keeps: those on its arguments that can be written to disk.

    Dropped: guards on globals and on object identity (they cannot be saved); what they guarded is
    in the file's key instead (`fingerprint` of the step's closures, the configs) or its sources.
    """
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    nested = [f"type({g.name})" for g in entries if _on_nested_class(g)]
    return [
        not (
            g.is_global
            or g.guard_type in unsaved
            or any(t in unsaved for t in g.derived_guard_types)
            or _on_nested_class(g)
            or any(hop in g.name for hop in nested)
        )
        for g in entries
    ]


def _on_nested_class(g) -> bool:
    """Whether `g` checks the type of an object whose class is nested or local (torch cannot save it: e.g. the
    `Func` modules `kernels` hangs on transformers' attention layers); the class's name is in the key, and its
    methods' sources are checked at load, so the guards reached through that class (its methods' closures and
    defaults: saved, they fail to build in the next process) are dropped too."""
    if g.guard_type not in ("TYPE_MATCH", "BUILTIN_MATCH") or not g.has_value:
        return False
    cls = type(g.value)
    return cls.__qualname__ != cls.__name__


def _key(fn, options: dict | None, args: tuple) -> str:
    """The digest that names a saved step: torch, Python, the compiler's configs, `fn`, options and args."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    h = hashlib.sha256()
    for part in (
        torch.__version__,
        sys.version,
        torch.backends.cpu.get_cpu_capability(),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
    ):
        h.update(repr(part).encode())
    for config in (torch._inductor.config, torch._functorch.config, torch._dynamo.config):
        settings = config.save_config_portable()
        settings.pop("debug_dir_root", None)  # (where debug dumps go: the working directory)
        h.update(_digest(settings, exact=True).encode())
    h.update(fingerprint(fn).encode())
    h.update(_digest(options or {}, exact=True).encode())
    h.update(fingerprint(args).encode())
    return h.hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _stable_repr(x: Any) -> str:
    """`repr(x)` without object addresses (they differ from process to process)."""
    return _ADDRESS.sub("", repr(x))


def fingerprint(obj: Any) -> str:
    """A digest of what `obj` computes with: its code, structure, types and tensors' metadata.

    Walks functions (code, defaults, closures, the globals they name, `functools.wraps` targets; a
    function of torch by its name), partials, bound methods, containers, dataclasses and any
    object's attributes (`nn.Module`s included: parameters and buffers by shape, dtype and device,
    never by value), once per object. A number, string or bool counts by its type, except where it
    is reached through a global: a saved step's guards check each such value the trace read (and
    only those: a learning rate a schedule closes over but the step never reads does not count),
    while Dynamo's guards on globals cannot be saved. Two processes that build the same step get the
    same digest; a changed module, function, global or shape changes it.

    Args:
      obj: the object (a step function, say).

    Returns:
      A hex digest.

    Example:
      >>> fingerprint(torch.nn.Tanh()) != fingerprint(torch.nn.ReLU())
      True
    """
    return _digest(obj, exact=False)


def _digest(obj: Any, exact: bool) -> str:
    """`fingerprint(obj)`, scalars by value when `exact`."""
    walker = _Walker(exact)
    walker.walk(obj)
    return walker.hash.hexdigest()


# Attributes that hold a per-process value and nothing the step computes with (transformers'
# GenerationConfig keeps the `hash()` of its own text, which differs from process to process).
_PER_PROCESS = {"_original_object_hash"}


class _Walker:
    """Feeds an object graph into one hash, each object once (later visits by number)."""

    def __init__(self, exact: bool = False):
        self.hash = hashlib.sha256()
        self.exact = exact  # scalars by value (reached through a global) or by type
        self.seen: dict[tuple[int, bool], int] = {}
        self.alive: list[Any] = []  # (keeps walked objects alive: their ids stay theirs)

    def put(self, *parts: Any) -> None:
        """Adds `parts` to the hash, each as a string, separated."""
        for p in parts:
            self.hash.update(str(p).encode())
            self.hash.update(b"\0")

    def walk(self, x: Any) -> None:
        """Adds `x` (and what it reaches) to the hash."""
        if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
            self.put(type(x).__name__, repr(x) if self.exact else "")
            return
        if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            self.put(repr(x))
            return
        memo = (id(x), self.exact)
        if memo in self.seen:
            self.put("@", self.seen[memo])
            return
        self.seen[memo] = len(self.seen)
        self.alive.append(x)
        self._walk_new(x)

    def _walk_new(self, x: Any) -> None:  # noqa: C901
        """Adds an object not seen before."""
        if isinstance(x, torch.Tensor):
            # (by metadata only: Dynamo passes a tensor in as a graph input, never its values as constants)
            self.put("tensor", type(x).__qualname__, tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
            if type(x) not in (torch.Tensor, torch.nn.Parameter) and hasattr(x, "__dict__"):
                self._attributes(x)
            return
        if isinstance(x, (types.ModuleType, type)):
            self.put(type(x).__name__, getattr(x, "__module__", ""), getattr(x, "__qualname__", x.__name__))
            return
        if isinstance(x, types.FunctionType):
            self._function(x)
            return
        if isinstance(x, types.MethodType):
            self.put("method")
            self.walk(x.__func__)
            self.walk(x.__self__)
            return
        if isinstance(x, functools.partial):
            self.put("partial")
            self.walk(x.func)
            self.walk(x.args)
            self.walk(x.keywords)
            return
        if isinstance(x, (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType)):
            self.put("builtin", getattr(x, "__module__", None), getattr(x, "__qualname__", repr(x)))
            return
        if isinstance(x, enum.Enum):
            self.put("enum", type(x).__qualname__, x.name)
            return
        if isinstance(x, dict):
            self.put(type(x).__qualname__, len(x))
            for k, v in x.items():
                self.walk(k)
                self.walk(v)
            return
        if isinstance(x, (list, tuple)):
            self.put(type(x).__module__, type(x).__qualname__, len(x))
            for v in x:
                self.walk(v)
            return
        if isinstance(x, (set, frozenset)):
            self.put(type(x).__qualname__, *sorted(_digest(v, self.exact) for v in x))
            return
        self._attributes(x)

    def _function(self, f: types.FunctionType) -> None:
        """Adds a function: its code, defaults, closure cells, the globals it names and its attributes."""
        module = f.__module__ or ""
        if module == "torch" or module.startswith("torch."):  # (torch's version is in the key)
            self.put("torch function", module, f.__qualname__)
            return
        self.put("function", module, f.__qualname__, _code_digest(f.__code__))
        exact, self.exact = self.exact, True
        for name in sorted(_global_names(f.__code__) & f.__globals__.keys()):
            self.put(name)
            self.walk(f.__globals__[name])
        self.exact = exact
        self.walk(f.__defaults__)
        self.walk(f.__kwdefaults__)
        for cell in f.__closure__ or ():
            try:
                self.walk(cell.cell_contents)
            except ValueError:  # an empty cell
                self.put("empty cell")
        self.walk(dict(sorted(vars(f).items())))

    def _attributes(self, x: Any) -> None:
        """Adds an object by its type and its attributes (`__dict__` and `__slots__`)."""
        cls = type(x)
        self.put("object", cls.__module__, cls.__qualname__)
        if dataclasses.is_dataclass(x) and not hasattr(x, "__dict__"):
            for f in dataclasses.fields(x):
                self.put(f.name)
                self.walk(getattr(x, f.name))
        attrs = getattr(x, "__dict__", None)
        if isinstance(attrs, dict):
            for k in sorted(set(attrs) - _PER_PROCESS, key=str):
                self.put(k)
                self.walk(attrs[k])
        for slot in (s for c in cls.__mro__ for s in getattr(c, "__slots__", ()) if isinstance(s, str)):
            if slot not in ("__dict__", "__weakref__") and hasattr(x, slot):
                self.put(slot)
                self.walk(getattr(x, slot))
        if attrs is None and not getattr(cls, "__slots__", None):
            self.put(_stable_repr(x)[:200])  # (an object of C: what its repr tells)


def _global_names(code: types.CodeType) -> set[str]:
    """The names a code object (and the code nested in it) may read as globals."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _code_digest(code: types.CodeType) -> str:
    """A digest of a code object: its bytecode, names and constants (nested code objects too)."""
    h = hashlib.sha256(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for c in code.co_consts:
        h.update((_code_digest(c) if isinstance(c, types.CodeType) else repr(c)).encode())
    return h.hexdigest()


def _is_dtensor(x: Any) -> bool:
    """Whether `x` is a DTensor (without importing torch.distributed when it is not loaded)."""
    dt = sys.modules.get("torch.distributed.tensor")
    return dt is not None and isinstance(x, getattr(dt, "DTensor", ()))
