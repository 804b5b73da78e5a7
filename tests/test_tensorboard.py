"""TensorBoardWriter (torch's SummaryWriter underneath), read back with tensorboard's readers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functrain.trainer import tensorboard as tb_lib
from functrain.trainer.tensorboard import TensorBoardWriter

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing import event_accumulator, event_file_loader  # noqa: E402


def _write_run(logdir):
    """Writes five steps of mixed metrics; returns the event file."""
    with TensorBoardWriter(logdir) as w:
        for i in range(1, 6):
            w.write(
                10 * i,
                {
                    "loss": 5.0 / i,
                    "lr": torch.tensor(1e-3 * i),
                    "tokens_per_s": np.float32(1000 * i),
                    "eta": "3m",
                    "steps_done": i,
                    "val": None,
                },
            )
        w.write(60, {"eta": "0s"})  # nothing numeric: no event
    (path,) = logdir.glob("events.out.tfevents.*")
    return path


def _events(path):
    """Every event in the file, via tensorboard's loader (which checks the records' CRCs)."""
    return list(event_file_loader.EventFileLoader(str(path)).Load())


def test_one_event_per_numeric_value_after_the_version_record(tmp_path):
    events = _events(_write_run(tmp_path))
    assert len(events) == 1 + 5 * 4  # loss, lr, tokens_per_s, steps_done at 5 steps; "eta" and None skipped
    assert events[0].file_version == "brain.Event:2" and events[0].wall_time > 1e9
    assert [e.step for e in events[1:]] == [10 * i for i in range(1, 6) for _ in range(4)]
    assert len({e.wall_time for e in events[1:5]}) == 1  # one write, one wall time


def test_event_accumulator_reads_our_scalars(tmp_path):
    _write_run(tmp_path)
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "lr", "steps_done", "tokens_per_s"]
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [10, 20, 30, 40, 50]
    np.testing.assert_allclose([e.value for e in loss], [5.0 / i for i in range(1, 6)], rtol=1e-6)
    np.testing.assert_allclose([e.value for e in acc.Scalars("lr")], [1e-3 * i for i in range(1, 6)], rtol=1e-6)
    assert [e.value for e in acc.Scalars("steps_done")] == [1, 2, 3, 4, 5]


def test_each_write_is_visible_before_close(tmp_path):
    w = TensorBoardWriter(tmp_path)
    w.write(7, {"loss": 1.5})
    (path,) = tmp_path.glob("events.out.tfevents.*")
    assert [e.step for e in _events(path)][-1] == 7  # flushed per write: a running TensorBoard sees it
    w.close()
    w.close()  # idempotent


def test_large_and_negative_steps_and_nonfinite_values(tmp_path):
    with TensorBoardWriter(tmp_path) as w:
        w.write(2**40, {"loss": float("inf")})
        w.write(2**40 + 1, {"loss": float("nan")})
        w.write(-3, {"x": 1.5})
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [2**40, 2**40 + 1]
    assert events[0].value == float("inf") and np.isnan(events[1].value)
    (path,) = tmp_path.glob("events.out.tfevents.*")
    assert _events(path)[-1].step == -3


def test_loop_says_how_to_get_tensorboard_when_missing(tmp_path, monkeypatch):
    from functrain.trainer import loop

    monkeypatch.setattr(tb_lib, "available", lambda: False)
    lines = []
    writers = loop._writers(True, tmp_path, lines.append)
    assert lines == [tb_lib.MISSING] and "pip install tensorboard" in lines[0]
    assert all(not isinstance(w, TensorBoardWriter) for w in writers)
    assert (tmp_path / "metrics.jsonl").exists()
