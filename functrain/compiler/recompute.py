"""Cheap activations recomputed in the backward of the one-graph step, not held from the forward.

AOTAutograd's partitioner recomputes pointwise values in the backward instead of saving them when
their inputs are saved anyway (a layer norm's output from its input and statistics, GELU's output
from its input). functrain's one-graph step has no partitioner: `torch.func.vjp` traced into one
forward graph keeps every value its backward reads. A kept GPT block (remat "none", or a block that
policy N does not recompute) held 18 values of its width per token from its forward to its
backward: its input, the first layer norm's output, q, k, v, the attention output and a transposed
copy of it, the residual after attention, the second layer norm's output, the MLP's pre-activation
(4) and GELU's output (4). With this pass it holds 10: the layer norms' outputs, GELU's output and
the transposed copy are computed again in the backward (read from the post-grad graph of a 2-block
GPT step).

`RecomputePass` (an inductor post-grad pass that `functrain.step` installs next to
`compiler.regather.RegatherPass`) does the partitioner's part on the graph. The staged loss marks the
end of the blocks' forward (`compiler.marks.mark_forward_done`). Every value computed before the
mark and read after it that is
  - pointwise or a rearrangement (views, permutes, clones; not random), and
  - computable again from values held across the mark anyway (the step's inputs, other values read
    after the mark, or small ones: at most 1/64 of the largest held value, such as a layer norm's
    mean and 1/std),
is computed again, by copies of the nodes that made it, just before its first reader after the mark;
the forward's value then dies after its last forward reader. Inductor fuses the copies into the
backward's kernels (or a buffer that lives only during that block's backward).

Same math, other kernels: the recomputed values come from kernels fused differently from the
forward's, so they may differ from the held ones in the last bit (the compiler may contract a
multiply-add into an FMA in one kernel and not in the other); losses and gradients agree within
float32 rounding.

Measured results: docs/results.md.

Example:
    >>> torch.compile(step, options={"post_grad_custom_post_pass": RecomputePass()})
"""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from functrain.compiler import marks  # noqa: F401 - registers functrain::forward_done (the mark)
from functrain.compiler.regather import REARRANGE, split_at_mark

__all__ = ["RecomputePass", "recompute_cheap"]

_log = logging.getLogger(__name__)
_MAX_CHAIN = 48  # nodes copied for one held value at most: longer pointwise chains stay held
_SMALL = 64  # an input this many times smaller than the largest held value may be held longer


class RecomputePass(CustomGraphPass):
    """Inductor post-grad pass: cheap values read across `mark_forward_done` are recomputed there.

    What it does: the module docstring. On a graph without the mark it does nothing.

    Example:
      >>> torch._inductor.config.post_grad_custom_post_pass = RecomputePass()
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        n = recompute_cheap(graph)
        if n:
            _log.info("recomputed %d held values after the forward", n, extra={"recomputed": n})

    def uuid(self):
        return get_hash_for_files((__file__,))


def recompute_cheap(graph: torch.fx.Graph) -> int:
    """Rewrites `graph` in place (see the module docstring); returns how many held values it recomputes.

    Args:
      graph: an FX graph of aten ops (post-grad, or traced with make_fx) with `mark_forward_done`.

    Returns:
      The number of values computed before the mark whose readers after it now read a copy (0 when
      the graph has no mark).

    Example:
      >>> recompute_cheap(gm.graph)
    """
    split = split_at_mark(graph)
    if split is None:
        return 0
    nodes, pos, mark = split
    held: dict = {}  # the values held across the mark -> their readers after it
    for n in nodes[:mark]:
        readers = [u for u in n.users if pos[u] > mark and u.op != "output"] if n.op == "call_function" else []
        if readers:
            held[n] = readers
    small = max((_numel(n) for n in held), default=0) // _SMALL
    chain: dict = {}  # node -> the nodes to copy to compute it again (itself included), or None

    def plan(n):
        """The nodes that compute `n` again from held values (itself last), None if it must be held."""
        if n in chain:
            return chain[n]
        chain[n] = None
        if not _cheap(n):
            return None
        out: dict = {}
        for a in n.all_input_nodes:
            sub = plan(a)
            if sub is not None:
                out.update(dict.fromkeys(sub))
            elif not (a.op in ("placeholder", "get_attr") or a in held or _numel(a) <= small):
                return None  # would hold a large value the backward does not read
        out[n] = None
        chain[n] = list(out) if len(out) <= _MAX_CHAIN else None
        return chain[n]

    todo = sorted((n for n in held if plan(n)), key=lambda n: min(pos[u] for u in held[n]))
    copies: dict = {}
    for n in todo:
        readers = held[n]
        with graph.inserting_before(min(readers, key=pos.__getitem__)):
            for c in sorted(chain[n], key=pos.__getitem__):
                if c not in copies:
                    copies[c] = graph.node_copy(c, lambda a: copies.get(a, a))
        for u in readers:
            u.replace_input_with(n, copies[n])
    if todo:
        graph.lint()
    return len(todo)


def _numel(n) -> int:
    """Elements of the tensor node `n` computes (0 if it is not one tensor)."""
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _cheap(n) -> bool:
    """Whether `n` is a pointwise op or a rearrangement of one tensor, and not random."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    tags = n.target.tags
    if torch.Tag.nondeterministic_seeded in tags or not isinstance(n.meta.get("val"), torch.Tensor):
        return False
    return torch.Tag.pointwise in tags or n.target in REARRANGE
