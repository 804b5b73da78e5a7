"""Cheap activations recomputed in the backward of the one-graph step, not held from the forward.

Internals: docs/internals.md "functrain.compiler.recompute".

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


def recompute_cheap(graph: torch.fx.Graph) -> int:  # noqa: C901
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
