"""TensorBoard event files from ``MetricsWriter``, read back from the bytes on disk.

The event files are parsed here with an independent TFRecord reader (little-endian u64
length, masked CRC-32C of the length, payload, masked CRC-32C of the payload; the CRC is
computed by a table-free bitwise CRC-32C below, not tensorboardX's) and each payload is
decoded with the ``Event`` protobuf class bundled with tensorboardX.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import sys

import numpy as np
import pytest

from sbm_jax.training.metrics import MetricsWriter

pytest.importorskip("tensorboardX")
from tensorboardX.proto.event_pb2 import Event  # noqa: E402

CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (CRC32C_POLY if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_tfrecords(path: str) -> list[bytes]:
    """Payloads of a TFRecord file, checking both CRCs of every record."""
    with open(path, "rb") as f:
        blob = f.read()
    records, pos = [], 0
    while pos < len(blob):
        header = blob[pos : pos + 8]
        assert len(header) == 8, f"truncated length at byte {pos} of {path}"
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", blob[pos + 8 : pos + 12])
        assert length_crc == masked_crc(header), f"bad length CRC at byte {pos}"
        data = blob[pos + 12 : pos + 12 + length]
        assert len(data) == length, f"truncated record at byte {pos} of {path}"
        (data_crc,) = struct.unpack("<I", blob[pos + 12 + length : pos + 16 + length])
        assert data_crc == masked_crc(data), f"bad data CRC at byte {pos}"
        records.append(data)
        pos += 16 + length
    return records


def read_scalars(logdir: str) -> tuple[dict[tuple[str, int], float], int]:
    """{(tag, step): value} over every event file in ``logdir``, and the file count."""
    files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    scalars: dict[tuple[str, int], float] = {}
    for path in files:
        payloads = read_tfrecords(path)
        first = Event.FromString(payloads[0])
        assert first.file_version == "brain.Event:2"
        for payload in payloads[1:]:
            event = Event.FromString(payload)
            for value in event.summary.value:
                key = (value.tag, int(event.step))
                assert key not in scalars, f"{key} written twice"
                scalars[key] = value.simple_value
    return scalars, len(files)


def f32(x: float) -> float:
    return float(np.float32(x))


def test_crc32c_reference_vector():
    # The standard CRC-32C check value (RFC 3720, appendix B.4).
    assert crc32c(b"123456789") == 0xE3069283


def test_event_files_hold_every_numeric_scalar(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write(
        {
            "step": 1,
            "split": "train",
            "time_s": 3.5,
            "loss": np.float32(0.5),
            "accuracy": 0.25,
            "density_per_head": [[0.1, 0.2], [0.3, 0.4]],
            "edges_per_head": {"encoder/block_0/attention": np.array([7.0, 9.0])},
            "note": "not a number",
            "flag": True,
            "missing": None,
        }
    )
    writer.write({"step": 2, "loss": 0.25, "learning_rate": 1e-3, "ids": [3, 4]})
    writer.write({"step": 2, "split": "dev", "accuracy": 0.75, "loss": 0.4})
    writer.write({"step": 3, "split": "test", "accuracy": 0.625})
    writer.flush()  # read before close: flush must have put everything on disk
    scalars, n_files = read_scalars(os.path.join(str(tmp_path), "tensorboard"))
    expected = {
        ("train/loss", 1): 0.5,
        ("train/accuracy", 1): 0.25,
        ("train/density_per_head/layer0_head0", 1): 0.1,
        ("train/density_per_head/layer0_head1", 1): 0.2,
        ("train/density_per_head/layer1_head0", 1): 0.3,
        ("train/density_per_head/layer1_head1", 1): 0.4,
        ("train/edges_per_head/encoder/block_0/attention/head0", 1): 7.0,
        ("train/edges_per_head/encoder/block_0/attention/head1", 1): 9.0,
        ("train/loss", 2): 0.25,
        ("train/learning_rate", 2): 1e-3,
        ("train/ids/0", 2): 3.0,
        ("train/ids/1", 2): 4.0,
        ("dev/accuracy", 2): 0.75,
        ("dev/loss", 2): 0.4,
        ("test/accuracy", 3): 0.625,
    }
    assert n_files == 1
    assert set(scalars) == set(expected)
    for key, value in expected.items():
        assert scalars[key] == f32(value), key
    writer.close()
    assert read_scalars(os.path.join(str(tmp_path), "tensorboard"))[0] == scalars


def test_resume_appends_a_second_event_file(tmp_path):
    first = MetricsWriter(str(tmp_path))
    first.write({"step": 1, "loss": 1.0})
    first.write({"step": 2, "loss": 0.75})
    first.close()
    # Reopened at once (same second, same host): must not overwrite the first file.
    second = MetricsWriter(str(tmp_path))
    second.write({"step": 3, "loss": 0.5})
    second.write({"step": 3, "split": "dev", "accuracy": 0.875})
    second.close()
    scalars, n_files = read_scalars(os.path.join(str(tmp_path), "tensorboard"))
    assert n_files == 2
    assert scalars == {
        ("train/loss", 1): 1.0,
        ("train/loss", 2): 0.75,
        ("train/loss", 3): 0.5,
        ("dev/accuracy", 3): 0.875,
    }
    with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 3]


def test_tensorboard_false_writes_and_imports_nothing(tmp_path, monkeypatch):
    # None entries make any import of tensorboardX or its submodules raise ImportError.
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboardX"] + ["tensorboardX"]:
        monkeypatch.setitem(sys.modules, name, None)
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    writer.write({"step": 1, "loss": 0.5})
    writer.write({"loss": 0.25})  # no step is fine without TensorBoard
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv", "metrics.jsonl"]
    with pytest.raises(ImportError, match="tensorboard=False"):
        MetricsWriter(str(tmp_path / "other"))


def test_record_without_integer_step_is_rejected(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    with pytest.raises(ValueError, match="'step'"):
        writer.write({"loss": 0.5})
    with pytest.raises(ValueError, match="'step'"):
        writer.write({"step": 1.5, "loss": 0.5})
    writer.write({"step": np.int64(4), "loss": 0.5})
    writer.close()
    with open(writer.jsonl_path) as f:
        assert [json.loads(line)["step"] for line in f] == [4]
    scalars, _ = read_scalars(os.path.join(str(tmp_path), "tensorboard"))
    assert scalars == {("train/loss", 4): 0.5}
