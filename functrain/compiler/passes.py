"""functrain's inductor post-grad passes, installed on the one-graph step.

Internals: docs/internals.md "functrain.compiler.passes".
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from functrain.compiler.compile import inductor_options
from functrain.compiler.recompute import RecomputePass
from functrain.compiler.regather import RegatherPass
from functrain.compiler.sdpa_seeds import SdpaSeedPass

__all__ = ["InTurn", "with_step_passes"]


class InTurn(CustomGraphPass):
    """One inductor graph pass that runs `passes` in order; its cache key is made of theirs.

    Example:
      >>> torch.compile(fn, options={"post_grad_custom_post_pass": InTurn([RecomputePass(), RegatherPass()])})
    """

    def __init__(self, passes: list):
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self):
        keys = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes)
        return None if None in keys else keys  # (None: a member cannot be cached, so neither can this)


def with_step_passes(options: dict | None) -> dict:
    """`torch.compile` keyword arguments with functrain's post-grad passes after the caller's own.

    A `mode` becomes the inductor options it stands for (`compiler.compile.inductor_options`), so the
    passes run under a mode too. Another backend, or a mode given with options (torch.compile's own
    error), is passed on unchanged.

    Args:
      options: the caller's `torch.compile` keyword arguments (or None).

    Returns:
      The keyword arguments to compile the step with.

    Example:
      >>> torch.compile(step, fullgraph=True, **with_step_passes({"mode": "max-autotune"}))
    """
    options = inductor_options(options)
    if options.get("backend", "inductor") != "inductor" or "mode" in options:  # (a mode left in: its error)
        return options
    inductor = dict(options["options"])
    mine = inductor.get("post_grad_custom_post_pass")
    mine = [] if mine is None else list(mine) if isinstance(mine, (list, tuple)) else [mine]
    inductor["post_grad_custom_post_pass"] = InTurn([*mine, RecomputePass(), RegatherPass(), SdpaSeedPass()])
    options["options"] = inductor
    return options
