"""`torch.compile` for functrain's step functions: one graph, the hyper-parameters passed as tensors.

Internals: docs/internals.md "functrain.compiler.compile".
"""

from __future__ import annotations

import functools
import types
from typing import Any

import optree
import torch
from torch._inductor import list_mode_options
from torch._inductor.custom_graph_pass import CustomGraphPass

from functrain.compiler import cache, graph_breaks, like_draws, mesh_key, saved_steps

__all__ = ["graph", "maybe_compile", "records_cuda_graphs", "scan"]


def scan(body, init, xs):
    """torch's `scan` higher-order op: `(carry, ys) = scan(body, init, xs)` over xs' leading dim.

    Args:
      body: `(carry, x) -> (new carry, y)`.
      init: the initial carry (a pytree of tensors).
      xs: a pytree of tensors scanned along dim 0.

    Returns:
      `(final carry, stacked ys)`.

    Example:
      >>> (total, _), _ = scan(lambda c, x: ((c[0] + x, None), x), (torch.zeros(()), None), xs)
    """
    from torch._higher_order_ops.scan import scan as torch_scan

    return torch_scan(body, init, xs)


def graph(fn, options: dict | None = None, *, name: str | None = None):
    """`torch.compile(fn, fullgraph=True, dynamic=False, **options)`: one graph, no dynamic shapes.

    Args:
      fn: the function to compile (a stage of a staged loss, say).
      options: extra keyword arguments for `torch.compile`.
      name: compile a copy of `fn` with a code object of its own under this name: Dynamo caches graphs
        (and counts recompiles) per code object, so each shape compiled under its own name is a first
        compile, not a recompile of the others (e.g. one per padded length).

    Returns:
      The compiled function.

    Example:
      >>> block = compiler.graph(block_fn)
      >>> prefill_64 = compiler.graph(prefill, name="prefill_64")
    """
    if name is not None:
        code = fn.__code__.replace(co_name=name)
        fn = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    mesh_key.register()  # (a sharded step's cache keys must not hold a per-process hash)
    like_draws.route()  # (keyed rand_like and friends compiled as eagerly)
    options = inductor_options({"fullgraph": True, "dynamic": False, **(options or {})})
    if _is_inductor(options) and "mode" not in options:  # (a mode left in: torch.compile's own error)
        inductor = {**_INDUCTOR, **options["options"]}
        inductor["post_grad_custom_pre_pass"] = _AfterIsaProbe(inductor.get("post_grad_custom_pre_pass"))
        options["options"] = inductor
    return torch.compile(fn, **options)


class _AfterIsaProbe(CustomGraphPass):
    """A pass that waits for the vector-ISA probe (`cache.wait_for_isa_probe`), then runs the pass it wraps."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, graph) -> None:
        cache.wait_for_isa_probe()
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        if self.then is None:
            return "functrain-after-isa-probe"
        inner = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
        return None if inner is None else ("functrain-after-isa-probe", inner)  # (None: not cacheable)


def inductor_options(options: dict | None) -> dict:
    """`torch.compile` keyword arguments with a `mode` written as the inductor options it stands for.

    torch.compile takes a mode or inductor options, not both: a mode becomes its options
    (`list_mode_options`, what torch.compile applies for it), so more options can be added under a
    mode too. Another backend, or a mode given with options (torch.compile's own error), is passed
    on unchanged.

    Args:
      options: the caller's `torch.compile` keyword arguments (or None).

    Returns:
      A new dict; for inductor without that error, with an `options` dict and no `mode`.

    Example:
      >>> compiler.inductor_options({"mode": "max-autotune"})["options"]["max_autotune"]
      True
    """
    options = dict(options or {})
    if not _is_inductor(options) or (options.get("mode") is not None and options.get("options") is not None):
        return options
    mode = options.pop("mode", None)
    stands_for = list_mode_options(mode, options.get("dynamic")) if mode is not None else {}
    options["options"] = {**stands_for, **(options.get("options") or {})}
    return options


# Inductor's scheduler tries to fuse each buffer group with up to this many others (torch's default:
# 64). A whole step holds hundreds of independent optimizer updates, and those tries were about half
# of its Scheduler.__init__; with 8 the measured steps' kernels are the same ones, found in half the
# time (docs/results.md, "The compiled step against torch.compile"). A caller's own options win.
_INDUCTOR = {"max_fusion_buffer_group_pairwise_attempts": 8}


def records_cuda_graphs(options: dict | None) -> bool:
    """Whether `torch.compile(**options)` records CUDA graphs (inductor's cudagraph trees).

    Args:
      options: `torch.compile` keyword arguments (a mode, or inductor options).

    Returns:
      True for `mode="reduce-overhead"` (or a mode standing for it) and for `triton.cudagraphs` set.

    Example:
      >>> compiler.records_cuda_graphs(cuda_graphs.options())
      True
    """
    expanded = inductor_options(options)
    return bool((expanded.get("options") or {}).get("triton.cudagraphs"))


def _is_inductor(options: dict | None) -> bool:
    """Whether `torch.compile(**options)` compiles with inductor (its default backend)."""
    return (options or {}).get("backend", "inductor") == "inductor"


def maybe_compile(fn, compile: bool, options: dict | None):
    """`torch.compile(fn, fullgraph=True, dynamic=False, **options)` when asked, with the 0-d float64
    CPU tensors of its arguments passed in as (1,) views (see `_lift`). Under `cache.setup`, a step
    that can be is saved whole at its first call and loaded by the next process (`saved_steps`)."""
    if not compile:
        return fn

    def lowered(lifted: dict, *args):
        if not lifted:
            return fn(*args)
        views, scalars = {}, {}  # index -> the caller's (1,) view; index -> the 0-d tensor fn sees
        for i, view in _at_paths(args, lifted):
            views[i], scalars[i] = view, view.view(())
        out = fn(*_replace_at(args, lifted, scalars))
        # a scalar fn hands back where it came from (a hyper-parameter in the new state) leaves as the
        # caller's own tensor: an output that is a view of an input costs a regeneration per call
        back = {i: views[i] for i, x in _at_paths(out, lifted) if x is scalars[i]}
        return _replace_at(out, lifted, back)

    # a code object of its own per `fn`: Dynamo caches (and counts recompiles) per code object
    code = lowered.__code__.replace(co_name=_name_of(fn))
    lowered = types.FunctionType(code, lowered.__globals__, code.co_name, None, lowered.__closure__)
    compiled = graph(lowered, options)
    chosen: list = []  # at the first call: the saved step, or `compiled`

    @functools.wraps(fn)
    def call(*args):
        lifted, args, views, originals = _lift(args)
        if not chosen:
            chosen.append(_first_call(compiled, lowered, options, (lifted, *args)))
        with graph_breaks.explained(lambda: lowered(lifted, *args)):  # a break in user code: one line, the ways on
            out = chosen[0](lifted, *args)
        if not lifted:
            return out
        back = {i: originals[i] for i, x in _at_paths(out, lifted) if x is views[i]}
        return _replace_at(out, lifted, back)

    return call


# Why lift. torch 2.13's fake tensors give every 0-d CPU int or float64 input a symbol for its value
# (FakeTensor.item_memo). The step never reads them as numbers, but inductor's tensorify pass meets the
# float64 ones (the optimizer's hyper-parameters), has Dynamo specialize them and restarts the whole
# trace ("Restarting analysis due to _tensorify_python_scalars"): a second Dynamo trace and AOT pass.
# Passed as (1,) views of the same storage they are plain tensors to Dynamo; in-place writes still land
# in the caller's tensors, and what comes back unchanged is the caller's own tensor (the saved
# restart: docs/results.md). Integer scalars (step, counts) make no restart and stay as they are.


def _name_of(fn) -> str:
    """`fn`'s name (a partial's function's), for Dynamo's code object and logs."""
    return str(getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "step"))


def _first_call(compiled, lowered, options: dict | None, args: tuple):
    """What runs the step from its first call on: a step saved whole when it can be (else `compiled`)."""
    if _is_inductor(options):
        _probe_for_cpu(args)
    directory = cache.saved_steps_dir()
    if directory is None or not saved_steps.usable(compiled, inductor_options(options), args):
        return compiled
    compile_with = functools.partial(_graph_with_guard_filter, lowered, options)
    return saved_steps.SavedStep(
        compile_with, lowered, options, lowered.__name__, directory, before_load=cache.wait_for_isa_probe
    )


def _graph_with_guard_filter(fn, options: dict | None, guard_filter_fn):
    """`graph(fn, options)` with Dynamo's guards filtered by `guard_filter_fn`."""
    opts = inductor_options(options)
    opts["options"] = {**opts.get("options", {}), "guard_filter_fn": guard_filter_fn}
    return graph(fn, opts)


def _probe_for_cpu(args: Any) -> None:
    """Starts inductor's CPU vector-ISA probe beside Dynamo's trace when `args` hold a CPU tensor (once a process)."""
    if not cache.probe_started() and any(
        isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in optree.tree_leaves(args, none_is_leaf=False)
    ):
        cache.start_isa_probe()


def _lift(args: Any) -> tuple[dict, tuple, dict, dict]:
    """(trie of paths to the 0-d float64 CPU tensors, args with those as (1,) views, {i: view}, {i: tensor})."""
    paths, leaves, _ = optree.tree_flatten_with_path(args)
    trie: dict = {}
    views: dict = {}
    originals: dict = {}
    index: dict = {}
    for path, x in zip(paths, leaves):
        if not (
            type(x) is torch.Tensor
            and x.dtype is torch.float64
            and x.ndim == 0
            and x.is_cpu
            and _plain_path(args, path)
        ):
            continue
        i = index.get(id(x))
        if i is None:  # one view per tensor: two views of one storage would be two aliased inputs
            i = index[id(x)] = len(index)
            originals[i], views[i] = x, x.view(1)
        node = trie
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = i
    return trie, _replace_at(args, trie, views), views, originals


def _plain_path(tree, path: tuple) -> bool:
    """Whether every node on `path` is a dict, list, tuple or NamedTuple (what `_replace_at` rebuilds)."""
    for k in path:
        found, tree = _child(tree, k)
        if not found:
            return False
    return True


def _child(node, key) -> tuple[bool, Any]:
    """(True, node[key]) for a dict, list, tuple or NamedTuple `node` that has `key`; else (False, None)."""
    if type(node) is dict:
        return (True, node[key]) if key in node else (False, None)
    if (
        (type(node) in (list, tuple) or (isinstance(node, tuple) and hasattr(node, "_fields")))
        and type(key) is int
        and 0 <= key < len(node)
    ):
        return True, node[key]
    return False, None


def _at_paths(tree, trie) -> list:
    """[(index, leaf)] for each path in `trie` (nested {key: subtrie}, leaves indices) that `tree` has."""
    if type(trie) is int:
        return [(trie, tree)]
    found = []
    for key, sub in trie.items():
        ok, child = _child(tree, key)
        if ok:
            found += _at_paths(child, sub)
    return found


def _replace_at(tree, trie, values: dict):
    """`tree` rebuilt with the leaf at each path in `trie` whose index is in `values` replaced by it."""
    return _replaced(tree, trie, values)[1]


def _replaced(tree, trie, values: dict) -> tuple[bool, Any]:
    """(whether anything was replaced, the tree): Dynamo cannot compare containers with `is`."""
    if type(trie) is int:
        return (True, values[trie]) if trie in values else (False, tree)
    changed = {}
    for key, sub in trie.items():
        ok, child = _child(tree, key)
        if ok:
            hit, new = _replaced(child, sub, values)
            if hit:
                changed[key] = new
    if not changed:
        return False, tree
    if type(tree) is dict:
        return True, {**tree, **changed}
    items = list(tree)
    for key, new in changed.items():
        items[key] = new
    if type(tree) is list:
        return True, items
    return True, tuple(items) if type(tree) is tuple else type(tree)(*items)
