"""A compiled step starts inductor's CPU vector-ISA probe at its first call on CPU tensors, once a process.

The probe (`functrain.compiler.cache.start_isa_probe`) then runs beside Dynamo's trace instead of
stalling inductor's first code generation; a step of another backend, or on other devices, never
starts it (no g++ for nothing). The probe itself is tested in tests/test_compile_cache.py.
"""

from __future__ import annotations

import pytest
import torch

from functrain import compiler
from functrain.compiler import cache as compile_cache
from functrain.compiler import compile as compile_lib


@pytest.fixture
def started(monkeypatch):
    """The calls to `start_isa_probe`, counted instead of run; the process's probe not yet started."""
    calls = []
    monkeypatch.setattr(compile_cache, "_PROBE", [])
    monkeypatch.setattr(compile_cache, "start_isa_probe", lambda: calls.append(1) or compile_cache._PROBE.append(1))
    return calls


def test_the_first_call_on_cpu_tensors_starts_the_probe_once(started):
    compile_lib._probe_for_cpu(({"w": torch.ones(2)}, (torch.zeros(()), None)))
    compile_lib._probe_for_cpu(({"w": torch.ones(2)},))
    assert started == [1]


def test_no_cpu_tensor_starts_nothing(started):
    compile_lib._probe_for_cpu(({"w": torch.ones(2, device="meta")}, 3, None))
    assert started == [] and not compile_cache.probe_started()


def test_another_backend_starts_nothing(started):
    step = compiler.maybe_compile(lambda x: x + 1, True, {"backend": "eager"})
    assert torch.equal(step(torch.ones(3)), torch.full((3,), 2.0))
    assert started == []


def test_the_inductor_step_starts_it_before_it_compiles(started, monkeypatch):
    seen = []
    monkeypatch.setattr(compile_lib, "graph", lambda fn, options: lambda *a: seen.append(list(started)) or fn(*a))
    step = compiler.maybe_compile(lambda x: x * 2, True, None)
    assert torch.equal(step(torch.ones(3)), torch.full((3,), 2.0))
    assert seen == [[1]]  # started when the compiled function was entered
