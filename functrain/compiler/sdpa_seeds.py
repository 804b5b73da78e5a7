"""The efficient-attention RNG seed and offset, unused without dropout, kept out of inductor's buffer reuse.

The bug this avoids. `aten._scaled_dot_product_efficient_attention` (the CUDA attention kernel that
`F.scaled_dot_product_attention` picks for float32) returns a philox seed and offset for its
backward: 0-d int64 tensors that the CUDA kernel allocates on the *CPU* (`at::empty({}, kLong)`
when there is no dropout). Fake-tensor propagation gives them the query's device, so inductor plans
them as CUDA buffers. Once the backward has read them they go to inductor's pool of freed buffers
(keyed by device, dtype, size, alignment and stream), and a later fresh 0-d int64 CUDA buffer (an
optimizer's step count when the state is not donated, an integer metric) can take one over. The
Triton kernel that writes it is then handed a CPU pointer and the step dies at its first launch:
"CUDA driver error: invalid argument" (or "Pointer argument ... cannot be accessed from Triton (cpu
tensor?)").

Measured results: docs/results.md.

What the pass does. Without dropout (`dropout_p == 0`) the backward never reads the seed and offset
(eager hands it the forward's CPU tensors as they are). Each such backward gets fresh `empty` 0-d
int64 tensors on the device inductor planned them on (the GPU), which really are there; the
forward's seed and offset then have no reader, so inductor allocates no buffer for them and nothing
can be given one. The step's graph keeps no CPU tensor (CUDA graphs stay possible). With dropout
the backward needs them, and the graph is left alone (functrain's GPT has no attention dropout).

Checked on the H200 (torch 2.11): the backward's gradients are bit-identical given the forward's
CPU seed and offset, CPU `empty` ones, or CUDA `empty` ones (dropout 0; eager calls of the two ops);
60 fp32 steps with `donate=False` give the donated run's losses and val loss to the last digit
printed (2.5861, 2.7532, 2.7062).

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
