"""Every use of torch's compiler internals in functrain, behind a few public names.

`functrain.step` keeps the mathematics of a step and asks this package for a compile unit:
`maybe_compile` (one `torch.compile(fullgraph=True)` graph, hyper-parameters passed as tensors),
`with_step_passes` (the one-graph step's inductor passes), `scan` (torch's scan higher-order op, for
gradient accumulation). The rest: the compile cache (`cache`), the marks a staged loss places in a
graph (`marks`) and the graph passes that read them (`recompute`, `regather`), the efficient-attention
seed pass (`sdpa_seeds`), CUDA graphs for the train step (`cuda_graphs`), whether plain autograd may run
(`transforms`), and the table of torch workarounds with a self-test each
(`workarounds`; docs/compiler.md), and the one-line account of a graph break in user code
(`graph_breaks`). Nothing outside this package imports `torch._dynamo`,
`torch._inductor`, `torch._functorch` or `torch._higher_order_ops` (tests/test_architecture.py).

Names load on first use (`functrain._lazy`), so `functrain.compiler.cache.setup` can run before
Dynamo is imported.

Example:
    >>> from functrain import compiler
    >>> step = compiler.maybe_compile(step_fn, True, compiler.with_step_passes(None))
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:
    from functrain.compiler import cache, cuda_graphs, like_draws, marks, recompute, regather, sdpa_seeds, workarounds
    from functrain.compiler.compile import graph, maybe_compile, scan
    from functrain.compiler.graph_breaks import GraphBreakError
    from functrain.compiler.marks import mark_forward_done, remat_barrier
    from functrain.compiler.passes import InTurn, with_step_passes
    from functrain.compiler.regather import RegatherPass, gathered_in_flight
    from functrain.compiler.transforms import eager_autograd_ok, inside_transform

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
