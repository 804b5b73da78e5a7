"""The options `compiler.graph` hands torch.compile: inductor's faster fusion search on every compiled
graph, under a `mode` too (expanded into the options it stands for), a caller's own options winning."""

import torch

from functrain import compiler


def _options_of(monkeypatch, options=None) -> dict:
    """The keyword arguments `compiler.graph(fn, options)` calls torch.compile with."""
    seen: dict = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.update(kwargs) or fn)
    compiler.graph(lambda x: x, options)
    return seen


def test_every_inductor_graph_gets_the_fusion_option(monkeypatch):
    assert _options_of(monkeypatch)["options"] == {"max_fusion_buffer_group_pairwise_attempts": 8}


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
