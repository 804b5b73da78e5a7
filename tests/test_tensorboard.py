"""TensorBoardWriter: CRC-32C vectors, the record framing, and tensorboard's own reader on our files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from functrain.tensorboard import TensorBoardWriter, crc32c, masked_crc32c


def test_crc32c_known_vectors():
    # RFC 3720 (iSCSI) appendix B.4 and the common check value.
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C


def test_masked_crc32c_matches_definition():
    crc = crc32c(b"abc")
    assert masked_crc32c(b"abc") == ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path):
    """The data of every TFRecord in `path`, checking lengths and both masked CRCs."""
    raw = path.read_bytes()
    out, pos = [], 0
    while pos < len(raw):
        (n,) = struct.unpack_from("<Q", raw, pos)
        (len_crc,) = struct.unpack_from("<I", raw, pos + 8)
        assert len_crc == masked_crc32c(raw[pos:pos + 8])
        data = raw[pos + 12:pos + 12 + n]
        (data_crc,) = struct.unpack_from("<I", raw, pos + 12 + n)
        assert data_crc == masked_crc32c(data)
        out.append(data)
        pos += 12 + n + 4
    assert pos == len(raw)
    return out


def _write_run(logdir):
    """Writes five steps of mixed metrics; returns the writer's path."""
    with TensorBoardWriter(logdir) as w:
        for i in range(1, 6):
            w.write(10 * i, {"loss": 5.0 / i, "lr": torch.tensor(1e-3 * i), "tokens_per_s": np.float32(1000 * i),
                             "eta": "3m", "steps_done": i, "val": None})
        w.write(60, {"eta": "0s"})  # nothing numeric: no event
    return w.path


def test_event_file_name_and_framing(tmp_path):
    path = _write_run(tmp_path)
    assert path.parent == tmp_path and path.name.startswith("events.out.tfevents.")
    records = _records(path)
    assert len(records) == 1 + 5  # file_version record + one per write with numbers
    assert b"brain.Event:2" in records[0]


def test_tensorboard_event_accumulator_reads_our_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.compat.proto import event_pb2

    path = _write_run(tmp_path)
    first = event_pb2.Event.FromString(_records(path)[0])
    assert first.file_version == "brain.Event:2" and first.wall_time > 1e9
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "lr", "steps_done", "tokens_per_s"]
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [10, 20, 30, 40, 50]
    np.testing.assert_allclose([e.value for e in loss], [5.0 / i for i in range(1, 6)], rtol=1e-6)
    np.testing.assert_allclose([e.value for e in acc.Scalars("lr")], [1e-3 * i for i in range(1, 6)], rtol=1e-6)
    assert [e.value for e in acc.Scalars("steps_done")] == [1, 2, 3, 4, 5]


def test_tensorboard_rejects_a_corrupted_record(tmp_path):
    """tensorboard checks the CRCs we write: flipping a data byte must break the read."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_file_loader

    path = _write_run(tmp_path)
    assert len(list(event_file_loader.EventFileLoader(str(path)).Load())) == 6
    raw = bytearray(path.read_bytes())
    raw[-6] ^= 0xFF  # inside the last record's data
    path.write_bytes(bytes(raw))
    assert len(list(event_file_loader.EventFileLoader(str(path)).Load())) == 5  # the bad record is dropped


def test_large_and_negative_steps_and_nonfinite_values(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    with TensorBoardWriter(tmp_path) as w:
        w.write(2**40, {"loss": float("inf")})
        w.write(2**40 + 1, {"loss": float("nan")})
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [2**40, 2**40 + 1]
    assert events[0].value == float("inf") and np.isnan(events[1].value)


def test_negative_step_is_a_two_complement_varint(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2

    with TensorBoardWriter(tmp_path) as w:
        w.write(-3, {"x": 1.5})
    ev = event_pb2.Event.FromString(_records(w.path)[1])
    assert ev.step == -3 and ev.summary.value[0].tag == "x" and ev.summary.value[0].simple_value == 1.5
