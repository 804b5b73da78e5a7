"""The options `compiler.graph` hands torch.compile: inductor's faster fusion search on every compiled
graph, under a `mode` too (expanded into the options it stands for), a caller's own options winning; and
a pass that waits for the vector-ISA probe before inductor lowers the graph."""

import threading
import time

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from functrain import compiler
from functrain.compiler import cache as compile_cache


def _options_of(monkeypatch, options=None) -> dict:
    """The keyword arguments `compiler.graph(fn, options)` calls torch.compile with."""
    seen: dict = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.update(kwargs) or fn)
    compiler.graph(lambda x: x, options)
    return seen


def test_every_inductor_graph_gets_the_fusion_option(monkeypatch):
    options = _options_of(monkeypatch)["options"]
    assert options.pop("max_fusion_buffer_group_pairwise_attempts") == 8
    assert list(options) == ["post_grad_custom_pre_pass"]  # (the wait for the ISA probe, below)


class _Recorded(CustomGraphPass):
    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append(graph)

    def uuid(self):
        return "recorded"


def test_every_inductor_graph_waits_for_the_isa_probe_then_runs_the_callers_pre_pass(monkeypatch):
    """Inductor asked for the vector ISA beside the probe thread probes again, racing it (other compiler flags
    for that compile's kernels): the pre-pass joins the probe first."""
    done: list = []
    probe = threading.Thread(target=lambda: (time.sleep(0.2), done.append(True)))
    monkeypatch.setattr(compile_cache, "_PROBE", [probe])
    theirs = _Recorded()
    wait = _options_of(monkeypatch, {"options": {"post_grad_custom_pre_pass": theirs}})["options"][
        "post_grad_custom_pre_pass"
    ]
    probe.start()
    wait("graph")
    assert done == [True] and theirs.graphs == ["graph"]  # the probe finished first, then the caller's pass ran
    assert wait.uuid() == ("functrain-after-isa-probe", "recorded")  # cacheable where the caller's pass is
    alone = _options_of(monkeypatch)["options"]["post_grad_custom_pre_pass"]
    assert alone.uuid() == "functrain-after-isa-probe"


def test_a_mode_becomes_its_options_and_keeps_the_fusion_option(monkeypatch):
    seen = _options_of(monkeypatch, {"mode": "max-autotune-no-cudagraphs"})
    assert "mode" not in seen
    assert seen["options"]["max_fusion_buffer_group_pairwise_attempts"] == 8
    assert seen["options"]["max_autotune"] is True  # what the mode stands for


def test_the_callers_options_win_and_other_backends_get_none(monkeypatch):
    seen = _options_of(monkeypatch, {"options": {"max_fusion_buffer_group_pairwise_attempts": 64}})
    assert seen["options"]["max_fusion_buffer_group_pairwise_attempts"] == 64
    assert "options" not in _options_of(monkeypatch, {"backend": "aot_eager"})
    both = _options_of(monkeypatch, {"mode": "max-autotune", "options": {"a": 1}})  # torch.compile's own error
    assert both["mode"] == "max-autotune" and both["options"] == {"a": 1}


def test_the_step_passes_follow_a_mode_and_leave_other_backends_alone():
    """`with_step_passes` expands a mode through the same `inductor_options` as `graph`."""
    under_mode = compiler.with_step_passes({"mode": "max-autotune-no-cudagraphs"})
    assert "mode" not in under_mode and under_mode["options"]["max_autotune"] is True
    assert isinstance(under_mode["options"]["post_grad_custom_post_pass"], compiler.InTurn)
    other = {"backend": "aot_eager", "options": {"a": 1}}
    assert compiler.with_step_passes(other) == other
    assert compiler.inductor_options(other) == other
