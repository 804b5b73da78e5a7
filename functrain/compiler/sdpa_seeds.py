"""The efficient-attention RNG seed and offset, unused without dropout, kept out of inductor's buffer reuse.

Internals: docs/internals.md "functrain.compiler.sdpa_seeds".

Example:
    >>> torch.compile(step, options={"post_grad_custom_post_pass": SdpaSeedPass()})
"""

from __future__ import annotations

import logging
import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["SdpaSeedPass", "unlink_unused_sdpa_seeds"]

_log = logging.getLogger(__name__)
_FWD = torch.ops.aten._scaled_dot_product_efficient_attention.default
_BWD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
_SEED, _OFFSET = 2, 3  # _FWD's outputs; _BWD takes them as its arguments 7 and 8


class SdpaSeedPass(CustomGraphPass):
    """Inductor post-grad pass: dropout-free efficient attention's CPU seed and offset never become buffers.

    Why and what: the module docstring. `functrain.step.make_train_step` installs it after the
    recompute and regather passes; on a graph without efficient attention it does nothing.

    Example:
      >>> torch._inductor.config.post_grad_custom_post_pass = SdpaSeedPass()
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        n = unlink_unused_sdpa_seeds(graph)
        if n:
            _log.info("gave %d efficient-attention backward(s) seeds of their own", n, extra={"sdpa_seeds": n})

    def uuid(self):
        return get_hash_for_files((__file__,))


def unlink_unused_sdpa_seeds(graph: torch.fx.Graph) -> int:
    """Rewrites `graph` in place (see the module docstring); returns how many backward calls it changed.

    Args:
      graph: an FX graph of aten ops (post-grad, or traced with make_fx) whose nodes carry fake
        values in `meta["val"]`.

    Returns:
      The number of `_scaled_dot_product_efficient_attention_backward` calls without dropout that
      now read fresh seed and offset tensors of their own (0 on a graph without them).

    Example:
      >>> unlink_unused_sdpa_seeds(gm.graph)
    """
    changed = set()
    for fwd in [n for n in graph.nodes if n.op == "call_function" and n.target is _FWD]:
        if _dropout(fwd, 5) != 0:
            continue
        for out in [u for u in fwd.users if u.target is operator.getitem and u.args[1] in (_SEED, _OFFSET)]:
            readers = list(out.users)
            if not all(r.target is _BWD and _dropout(r, 9) == 0 for r in readers):
                continue  # (read by something else: leave it)
            val = out.meta.get("val")
            if val is None:
                continue  # (no planned device to put the new one on)
            for reader in readers:
                with graph.inserting_before(reader):
                    fresh = graph.call_function(
                        torch.ops.aten.empty.memory_format, ([],), {"dtype": torch.int64, "device": val.device}
                    )
                fresh.meta["val"] = _empty_like(val)
                reader.replace_input_with(out, fresh)
                changed.add(reader)
            graph.erase_node(out)
    return len(changed)


def _dropout(node: torch.fx.Node, index: int) -> float:
    """The call's `dropout_p` (positional `index`, or keyword, default 0)."""
    p = node.args[index] if len(node.args) > index else node.kwargs.get("dropout_p", 0.0)
    return float(p)  # type: ignore[arg-type]  # an fx argument: here a Python number


def _empty_like(val):
    """A fake 0-d int64 tensor on `val`'s device, in `val`'s fake mode (None without one)."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return torch.empty((), dtype=torch.int64, device=val.device)
