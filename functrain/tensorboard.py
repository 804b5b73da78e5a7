"""A TensorBoard scalar writer with no dependency: TFRecord framing and protobuf encoding by hand.

An event file (`events.out.tfevents.<time>.<host>.<pid>`) is a sequence of TFRecords:

    uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

where masked_crc32c(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32), and each data is a
serialized `tensorflow.Event` protobuf. Only the fields needed for scalars are written:

    Event    { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary  { repeated Value value = 1; }
    Value    { string tag = 1; float simple_value = 2; }

The first record carries `file_version = "brain.Event:2"`. TensorBoard reads these files as it reads
TensorFlow's and torch.utils.tensorboard's (tested against tensorboard's `EventAccumulator`).

Example:
    >>> writer = TensorBoardWriter("runs/gpt/tb")
    >>> writer.write(100, {"loss": 2.13, "lr": 3e-4, "eta": "5m"})   # "eta" (not a number) is skipped
    >>> writer.close()
    # tensorboard --logdir runs/gpt/tb
"""

from __future__ import annotations

import numbers
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, Mapping

__all__ = ["TensorBoardWriter", "crc32c", "masked_crc32c"]


def _crc32c_table() -> list[int]:
    """The byte-wise lookup table of CRC-32C (Castagnoli, reflected polynomial 0x82F63B78)."""
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, as used by TFRecord framing.

    Args:
      data: the bytes.

    Returns:
      The checksum, an int in [0, 2**32).

    Example:
      >>> hex(crc32c(b"123456789"))
      '0xe3069283'
    """
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of `data`: ((crc >> 15) | (crc << 17)) + 0xa282ead8, mod 2**32.

    Args:
      data: the bytes.

    Returns:
      The masked checksum, an int in [0, 2**32).

    Example:
      >>> masked_crc32c(b"")
      2726488792
    """
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    """Protobuf base-128 varint of a (possibly negative, as int64) integer."""
    n &= 0xFFFFFFFFFFFFFFFF  # negative int64 -> two's complement, 10 bytes
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): strings and sub-messages."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None, summary: bytes | None = None) -> bytes:
    """A serialized `Event` protobuf."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)  # wall_time: double (wire type 1)
    out += _varint(2 << 3 | 0) + _varint(int(step))  # step: int64 varint
    if file_version is not None:
        out += _field_bytes(3, file_version.encode("utf-8"))
    if summary is not None:
        out += _field_bytes(5, summary)
    return out


def _summary(scalars: Mapping[str, float]) -> bytes:
    """A serialized `Summary` with one simple_value per tag."""
    out = b""
    for tag, value in scalars.items():
        value_msg = _field_bytes(1, tag.encode("utf-8")) + _varint(2 << 3 | 5) + struct.pack("<f", value)
        out += _field_bytes(1, value_msg)
    return out


def _record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _scalar(value: Any) -> float | None:
    """`value` as a float when it is a real number (0-d tensors and numpy scalars too), else None."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 or getattr(value, "shape", None) == ():  # torch / numpy 0-d
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


class TensorBoardWriter:
    """Writes scalar metrics to a TensorBoard event file, the same interface as `metrics.JsonlWriter`.

    Args:
      logdir: directory for the event file (created if missing). Point `tensorboard --logdir` at
        it (or at its parent to compare runs).
      filename_suffix: appended to the file name (e.g. ".rank0").

    Example:
      >>> with TensorBoardWriter(workdir / "tb") as tb:
      ...     tb.write(step, {"loss": 2.1, "val_loss": 2.3})
    """

    def __init__(self, logdir: str | os.PathLike, filename_suffix: str = ""):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}{filename_suffix}"
        self.path = self.logdir / name
        self._f = open(self.path, "ab")
        self._f.write(_record(_event(time.time(), 0, file_version="brain.Event:2")))
        self._f.flush()

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Appends one event holding every numeric entry of `metrics` as a scalar at `step`.

        Strings (e.g. "eta") and other non-numbers are skipped; 0-d tensors are read with `float()`.
        """
        scalars = {}
        for k, v in metrics.items():
            x = _scalar(v)
            if x is not None:
                scalars[str(k)] = x  # NaN / inf are written as such; TensorBoard shows them
        if not scalars:
            return
        self._f.write(_record(_event(time.time(), int(step), summary=_summary(scalars))))
        self._f.flush()  # TensorBoard tails the file: make each step visible at once

    def close(self) -> None:
        """Closes the file (idempotent)."""
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "TensorBoardWriter":
        """The writer itself (closed on exit)."""
        return self

    def __exit__(self, *exc) -> None:
        """Closes the file."""
        self.close()
