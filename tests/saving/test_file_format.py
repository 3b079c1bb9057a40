"""The files a checkpoint is written in: safetensors of every dtype with each tensor's checksum
(fxstar/saving/file_format.py writes through fxstar.weights.write_safetensors)."""

import torch
from safetensors import safe_open


def test_write_safetensors_round_trips_every_dtype_and_its_checksums(tmp_path):
    import zlib

    from fxstar.weights import write_safetensors

    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "i64": torch.arange(7),
        "flag": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4), "view": torch.randn(6, 6)[:, 1],
    }  # fmt: skip
    crcs = write_safetensors(tmp_path / "t.safetensors", tensors, {"format": "pt", "k": "v"})
    with safe_open(tmp_path / "t.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
        for name, t in tensors.items():
            read = f.get_tensor(name)
            assert read.dtype == t.dtype and torch.equal(read, t), name
            data = read.reshape(-1).view(torch.uint8).numpy().tobytes() if read.numel() else b""
            assert crcs[name] == zlib.crc32(data), name
