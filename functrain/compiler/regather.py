"""Reshard after forward for kept blocks: the compiled step gathers their parameters again for the backward.

Internals: docs/internals.md "functrain.compiler.regather".

Example:
    >>> h = mark_forward_done(h)            # in a staged loss, after the last block
    >>> torch.compile(step, options={"post_grad_custom_post_pass": RegatherPass()})
"""

from __future__ import annotations

import functools
import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from functrain.compiler.marks import mark_forward_done, remat_barrier  # noqa: F401 - the ops `regather` reads and inserts

__all__ = ["RegatherPass", "gathered_in_flight", "regather"]

_log = logging.getLogger(__name__)  # INFO: each compiled graph's gathered-params model (bench/sharded.py)


def _renamed(new: dict, a):
    """`a`'s copy in `new`, or `a` itself."""
    return new.get(a, a)


def _ops(*names: str) -> frozenset:
    """The aten overloads named; one this torch lacks is an error naming it (no silent fallback)."""
    out = set()
    for name in names:
        op, _, overload = name.partition(".")
        try:
            out.add(getattr(getattr(torch.ops.aten, op), overload))
        except AttributeError:
            raise RuntimeError(
                f"functrain.compiler.regather: torch {torch.__version__} has no aten.{name}; "
                "the pass's op tables need updating for this release"
            ) from None
    return frozenset(out)


REARRANGE = _ops(
    "view.default",
    "reshape.default",
    "_unsafe_view.default",
    "slice.Tensor",
    "clone.default",
    "permute.default",
    "t.default",
    "transpose.int",
    "expand.default",
    "select.int",
    "squeeze.dim",
    "unsqueeze.default",
    "alias.default",
    "as_strided.default",
)
"""The aten ops that take one tensor and rearrange its values, with no arithmetic: what turns a
gathered flat buffer into parameters (and what `functrain.compiler.recompute` may copy freely)."""
# what builds an all-gather's input from the local shards (the parameters): recomputed, not held.
# (A post-grad graph casts with prims.convert_element_type, which is not here: under bf16 the second
# gather reads the forward's cast shard, which stays alive until then, as it always has.)
_FLATTEN = REARRANGE | _ops(
    "cat.default", "constant_pad_nd.default", "_to_copy.default", "new_zeros.default", "zeros.default", "full.default"
)


class RegatherPass(CustomGraphPass):
    """Inductor post-grad pass: values gathered before `mark_forward_done` and read after it are gathered again.

    What it does and what it saves: the module docstring. `functrain.step.make_train_step` adds it
    to the compiled step's inductor options; on a graph without `mark_forward_done` it does nothing.

    Example:
      >>> torch._inductor.config.post_grad_custom_post_pass = RegatherPass()
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        added = regather(graph)
        if _log.isEnabledFor(logging.INFO):
            m = gathered_in_flight(graph)
            if m["gathers"]:
                _log.info(
                    "regathered %d; gathered params alive at most %.1f MiB (%d of %d all-gathers, "
                    "the largest %.1f MiB)",
                    added,
                    m["peak_bytes"] / 2**20,
                    m["alive_at_peak"],
                    m["gathers"],
                    m["largest_bytes"] / 2**20,
                    extra={"gathered": m, "regathered": added},
                )

    def uuid(self):
        return get_hash_for_files((__file__,))


def regather(graph: torch.fx.Graph, prefetch: bool = True) -> int:
    """Rewrites `graph` in place (see the module docstring); returns how many all-gathers it added.

    Args:
      graph: a post-grad FX graph (functional collectives, aten ops).
      prefetch: issue each block's second all-gather when the backward reaches the block before
        it (FSDP's backward prefetch: two blocks gathered at a time, the transfer overlapping that
        block's compute), waiting for it only where it is read; False: issue it where it is read.

    Returns:
      The number of all-gathers added (0 when the graph has no `mark_forward_done`).

    Example:
      >>> regather(gm.graph)
    """
    gather_op, wait_op = _collectives()
    barrier = torch.ops.functrain.remat_barrier.default
    split = split_at_mark(graph)
    if split is None:
        return 0
    nodes, pos, mark = split
    plans = []  # (first late reader, its cotangent, the gather, its wait, the derived values needed, late readers)
    for gather in [n for n in nodes if n.target is gather_op and pos[n] < mark]:
        waits = [u for u in gather.users if u.target is wait_op]
        if len(waits) != 1 or len(gather.users) != 1:
            continue
        derived = _derived(waits[0])
        readers = [u for d in derived for u in d.users if u not in derived]
        late = list(dict.fromkeys(u for u in readers if pos[u] > mark))
        if not late or len(late) == len(set(readers)):
            continue  # read only before, or only after, the mark: nothing to free in between
        first = min(late, key=pos.__getitem__)
        after = next((a for a in first.all_input_nodes if a not in derived), nodes[mark])
        # the derived values the late readers need, and the tensors those come from
        need: set = set()
        stack = [a for u in late for a in u.all_input_nodes if a in derived]
        while stack:
            n = stack.pop()
            if n not in need:
                need.add(n)
                stack.extend(a for a in n.all_input_nodes if a in derived)
        plans.append((first, after, gather, waits[0], need, late))
    plans.sort(key=lambda plan: pos[plan[0]])  # in the backward's order
    for k, (first, after, gather, wait, need, late) in enumerate(plans):
        issue, issue_after = (plans[k - 1][0], plans[k - 1][1]) if prefetch and k else (first, after)
        new: dict = {}
        with graph.inserting_before(issue):
            flat = _recomputed(graph, gather.args[0], new)
            held = graph.call_function(barrier, (flat, issue_after))
            held.meta["val"] = flat.meta["val"]
            again = graph.call_function(gather_op, (held, *gather.args[1:]), dict(gather.kwargs))
            again.meta["val"] = gather.meta["val"]
        with graph.inserting_before(first):
            new[wait] = graph.call_function(wait_op, (again,))
            new[wait].meta["val"] = wait.meta["val"]
            for n in sorted(need - {wait}, key=pos.__getitem__):
                new[n] = graph.node_copy(n, functools.partial(_renamed, new))
        for u in late:
            for a in set(u.all_input_nodes) & need:
                u.replace_input_with(a, new[a])
    if plans:
        graph.eliminate_dead_code()
        graph.lint()
    return len(plans)


def split_at_mark(graph: torch.fx.Graph):
    """(the graph's nodes in order, {node: position}, the position of its first `mark_forward_done`),
    or None for a graph without the mark."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    end = next((n for n in nodes if n.target is torch.ops.functrain.forward_done.default), None)
    return None if end is None else (nodes, pos, pos[end])


def gathered_in_flight(graph: torch.fx.Graph) -> dict:
    """A model of the gathered parameters' buffers in `graph`: how many bytes are alive at once, at most.

    Each all-gather's output counts from the node that issues it to the last reader of it or of
    anything rearranged from it (views, slices, clones: the gathered values in parameter layout),
    in the graph's order; a buffer inductor frees after its last reader lives exactly that long.

    Args:
      graph: an FX graph with functional all-gathers (post-grad, or traced with make_fx).

    Returns:
      `{"peak_bytes", "gathers", "largest_bytes", "alive_at_peak"}`: the most gathered bytes alive
      at one point, the number of all-gathers, the largest one's bytes (one stage's parameters when
      each stage is gathered in one bucket) and how many were alive at the peak.

    Example:
      >>> m = gathered_in_flight(gm.graph)
      >>> m["peak_bytes"] / m["largest_bytes"]     # ~2: the block computing and the next one
      2.0
    """
    gather_op, wait_op = _collectives()
    pos = {n: i for i, n in enumerate(graph.nodes)}
    spans = []  # (issued, last read, bytes)
    for g in (n for n in graph.nodes if n.target is gather_op):
        val = g.meta.get("val")
        size = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
        alive = set().union(*(_derived(w) for w in g.users if w.target is wait_op)) | {g}
        spans.append((pos[g], max(pos[u] for n in alive for u in [n, *n.users]), size))
    events = sorted([(a, 1, b) for a, _, b in spans] + [(e + 0.5, -1, b) for _, e, b in spans])
    peak = live = count = at_peak = 0
    for _, sign, size in events:
        live += sign * size
        count += sign
        if live > peak:
            peak, at_peak = live, count
    return {
        "peak_bytes": peak,
        "gathers": len(spans),
        "largest_bytes": max((b for *_, b in spans), default=0),
        "alive_at_peak": at_peak,
    }


def _collectives() -> tuple:
    """(all-gather, wait): the functional collectives' ops as they appear in a traced graph."""
    return torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default


def _derived(wait) -> set:
    """The gathered values: `wait` and everything rearranged (or waited) from it alone."""
    out, stack = {wait}, [wait]
    while stack:
        for u in stack.pop().users:
            if u not in out and (u.target in REARRANGE or u.target is wait.target) and u.args and u.args[0] in out:
                out.add(u)
                stack.append(u)
    return out


def _recomputed(graph: torch.fx.Graph, node, new: dict):
    """A copy of `node` computed again from the graph's inputs when it is only a flattening of them
    (else `node` itself)."""
    if not isinstance(node, torch.fx.Node) or node.op in ("placeholder", "get_attr"):
        return node
    if node in new:
        return new[node]
    if node.op != "call_function" or node.target not in _FLATTEN:
        return node
    copies = {a: _recomputed(graph, a, new) for a in node.all_input_nodes}
    new[node] = graph.node_copy(node, lambda a: copies.get(a, a))
    return new[node]
