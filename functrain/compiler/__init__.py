"""Every use of torch's compiler internals in functrain, behind a few public names.

Internals: docs/internals.md "functrain.compiler".

Example:
    >>> from functrain import compiler
    >>> step = compiler.maybe_compile(step_fn, True, compiler.with_step_passes(None))
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:
    from functrain.compiler import cache, cuda_graphs, like_draws, marks, recompute, regather, sdpa_seeds, workarounds
    from functrain.compiler.compile import graph, inductor_options, maybe_compile, records_cuda_graphs, scan
    from functrain.compiler.graph_breaks import GraphBreakError
    from functrain.compiler.marks import mark_forward_done, remat_barrier
    from functrain.compiler.passes import InTurn, with_step_passes
    from functrain.compiler.regather import RegatherPass, gathered_in_flight
    from functrain.compiler.transforms import eager_autograd_ok, inside_transform

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
