"""Every torch workaround in functrain, each with a self-test of the premise it rests on.

Internals: docs/internals.md "functrain.compiler.workarounds".

Example:
    >>> from functrain.compiler import workarounds
    >>> for w in workarounds.WORKAROUNDS:
    ...     w.check()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["PremiseChanged", "Workaround", "WORKAROUNDS", "by_name"]


class PremiseChanged(AssertionError):
    """A workaround's premise no longer holds on the installed torch."""


class Workaround(NamedTuple):
    """One entry of the table.

    Attributes:
      name: a short identifier (the table's first column).
      mends: what goes wrong without it.
      issue: the torch issue, or this repository's reproducer.
      releases: the torch releases it was measured on.
      where: the module that holds it.
      check: `() -> None`; raises `PremiseChanged` when the premise no longer holds.
    """

    name: str
    mends: str
    issue: str
    releases: str
    where: str
    check: Callable[[], None]


def _fail(name: str, what: str) -> None:
    """Raises PremiseChanged for workaround `name`."""
    raise PremiseChanged(
        f"torch workaround {name!r} (functrain/compiler/workarounds.py): {what} on torch "
        f"{torch.__version__}; revisit it"
    )


def _check_float64_lift() -> None:
    """A 0-d float64 CPU input still makes Dynamo restart its analysis (two traces for one graph)."""
    from torch._dynamo.utils import compilation_time_metrics

    torch._dynamo.reset()
    compilation_time_metrics.clear()
    fn = torch.compile(lambda x, s: x * s + 1, fullgraph=True, dynamic=False, backend="aot_eager")
    fn(torch.randn(4), torch.tensor(0.5, dtype=torch.float64))
    traces = len(compilation_time_metrics.get("bytecode_tracing", []))
    torch._dynamo.reset()
    if traces < 2:
        _fail("float64_scalars_lifted", f"a 0-d float64 input traced {traces} time(s), no restart")


def _check_lerp_written_out() -> None:
    """`foreach.lerp` with a tensor weight compiles (the written-out form) and equals eager `x + w (y - x)`."""
    from functrain.ops import foreach

    xs, ys = [torch.linspace(-1, 1, 37), torch.linspace(0, 3, 5)], [torch.linspace(2, -2, 37), torch.ones(5)]
    w = torch.tensor(0.1)
    torch._dynamo.reset()
    got = torch.compile(foreach.lerp, fullgraph=True, dynamic=False)(xs, ys, w)
    torch._dynamo.reset()
    if not all(torch.equal(g, x + w * (y - x)) for g, x, y in zip(got, xs, ys)):
        _fail("foreach_lerp_tensor_weight", "the compiled written-out lerp no longer equals eager x + w (y - x)")


def _check_sdpa_seeds() -> None:
    """Fake propagation still puts efficient attention's CPU-made seed and offset on the query's device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 1, 8, 8, device="cuda")
        out = torch.ops.aten._scaled_dot_product_efficient_attention.default(q, q, q, None, True)
    if out[2].device.type != "cuda" or out[3].device.type != "cuda":
        _fail("sdpa_efficient_seeds", f"the seed/offset are fake {out[2].device}/{out[3].device} tensors")


def _check_mesh_hash() -> None:
    """`DeviceMesh.__getstate__` still keeps `_hash` (a per-process salted string hash)."""
    from functrain.compiler import mesh_key

    if not mesh_key.hash_is_pickled():
        _fail("mesh_hash_in_cache_key", "DeviceMesh pickles without _hash")


def _check_checkpoint_under_func() -> None:
    """`torch.utils.checkpoint` still cannot run under `torch.func.grad` (saved tensor hooks)."""
    from torch.utils.checkpoint import checkpoint

    try:
        torch.func.grad(lambda x: checkpoint(torch.sin, x, use_reentrant=False).sum())(torch.ones(3))
    except RuntimeError as exc:
        if "saved tensor hooks" in str(exc):
            return
        raise
    _fail("staged_remat_route", "torch.utils.checkpoint now runs under torch.func.grad")


def _check_gloo_threads() -> None:
    """torch's gloo groups still default to two worker threads, and functrain's backend still builds one-thread ones."""
    from functrain.parallel import gloo

    problem = gloo.premise_problem()
    if problem:
        _fail("gloo_one_thread", problem)


def _check_agent_store_unprefixed() -> None:
    """torch's env:// rendezvous under torchrun's agent store still hands over the run's one store with no
    prefix of the restart attempt."""
    from functrain.parallel import mesh

    problem = mesh.attempt_store_premise_problem()
    if problem:
        _fail("elastic_attempt_store", problem)


def _check_like_draws() -> None:
    """Dynamo's mode-dispatched set still misses `rand_like`, `randn_like` and `randint_like`."""
    from functrain.compiler import like_draws

    like_draws.dynamo_set()  # (the hook exists)
    if not like_draws.dynamo_misses_them():
        _fail("like_draws_routed", "torch now routes the random _like factories through torch function modes")


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "float64_scalars_lifted",
        "a 0-d float64 CPU input (an optimizer hyper-parameter) makes Dynamo restart its whole analysis "
        "(`_tensorify_python_scalars`): a second trace and AOT pass of the step; passed as (1,) views",
        "reproduced by tests/test_step.py (one trace, not two)",
        "2.13, 2.14",
        "functrain/compiler/compile.py (`_lift`)",
        _check_float64_lift,
    ),
    Workaround(
        "foreach_lerp_tensor_weight",
        "compiled `_foreach_lerp.Scalar` with a 0-d tensor weight: 2.14's decomposition branches on the "
        "unbacked weight (GuardOnDataDependentSymNode); compiled, lerp is written out as x + w (y - x)",
        "reproduced by configs/gpt.py:tiny on 2.14.1",
        "2.14 (on 2.13 the written-out form gives the same bits)",
        "functrain/ops/foreach.py (`lerp`)",
        _check_lerp_written_out,
    ),
    Workaround(
        "sdpa_efficient_seeds",
        "CUDA efficient attention makes its philox seed/offset on the CPU while inductor plans CUDA buffers; "
        "a reused buffer handed Triton a CPU pointer (fp32, donate=False); a post-grad pass gives the "
        "dropout-free backward fresh ones",
        "tests/test_sdpa_seeds.py",
        "2.11 (CUDA), 2.13, 2.14 (fake propagation)",
        "functrain/compiler/sdpa_seeds.py",
        _check_sdpa_seeds,
    ),
    Workaround(
        "mesh_hash_in_cache_key",
        "a DeviceMesh pickles its per-process salted hash into inductor's and AOTAutograd's cache keys, so "
        "every sharded run compiled cold; a copyreg reducer leaves it out",
        "tests/test_compile_cache.py (hits across two PYTHONHASHSEEDs)",
        "2.13, 2.14",
        "functrain/compiler/mesh_key.py",
        _check_mesh_hash,
    ),
    Workaround(
        "staged_remat_route",
        "`torch.utils.checkpoint` cannot run under `torch.func.grad` (no saved tensor hooks), and a custom "
        "autograd.Function's backward is dropped under torch.func + torch.compile; activation checkpointing "
        "is spelled out as per-stage vjps behind an opaque barrier op",
        "pytorch#193279",
        "2.13, 2.14",
        "functrain/step/staged.py, functrain/compiler/marks.py",
        _check_checkpoint_under_func,
    ),
    Workaround(
        "gloo_one_thread",
        "two collectives of one gloo group in flight on torch's two worker threads corrupt the heap "
        "(malloc aborts, segfaults, hangs); functrain's groups come from a backend of its own "
        "(torch's backend registry) that builds them with one thread",
        "bench/gloo_threads.py",
        "2.13, 2.14",
        "functrain/parallel/gloo.py",
        _check_gloo_threads,
    ),
    Workaround(
        "elastic_attempt_store",
        "torchrun keeps one store for every restart attempt and env:// hands it over unprefixed, so a "
        "restarted attempt's groups read the killed attempt's keys (gloo: connectFullMesh refused by a dead "
        "rank's port); the default group gets a store prefixed with the attempt",
        "bench/elastic.sh (kill -9 of a worker under --max-restarts=1)",
        "2.13, 2.14",
        "functrain/parallel/mesh.py (`attempt_store`)",
        _check_agent_store_unprefixed,
    ),
    Workaround(
        "like_draws_routed",
        "Dynamo hands a torch function mode only the functions of its overridable set, which lacks "
        "`rand_like`, `randn_like` and `randint_like` (eager torch hands them over): a compiled step drew "
        "them from torch's generator where the eager one drew from the key; they are added to that set",
        "tests/test_keyed_randomness.py (compiled noise = eager)",
        "2.13, 2.14",
        "functrain/compiler/like_draws.py",
        _check_like_draws,
    ),
)
"""The table (docs/compiler.md shows it)."""


def by_name(name: str) -> Workaround:
    """The workaround called `name`.

    Args:
      name: its table name.

    Returns:
      The `Workaround`.

    Example:
      >>> by_name("gloo_one_thread").check()
    """
    for w in WORKAROUNDS:
        if w.name == name:
            return w
    raise KeyError(f"no torch workaround named {name!r}; known: {[w.name for w in WORKAROUNDS]}")
