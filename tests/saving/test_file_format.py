"""The files a checkpoint is written in: safetensors of every dtype with each tensor's checksum
(fxstar/saving/file_format.py writes through fxstar.weights' streaming writer), deferred
tensors among them read as the writer reaches them."""

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


def test_write_tensors_reads_deferred_tensors_into_the_file_and_its_record(tmp_path):
    from fxstar.runtime.deferred import DeferredTensor
    from fxstar.saving.file_format import tensor_crc, write_tensors

    chunk = {(0, "exp_avg"): torch.randn(3, 2), (1, "exp_avg"): torch.randn(5)}
    reads = []

    class Chunks:
        def read(self, groups):
            for group in groups:
                reads.append(group)
                yield group, chunk

    source = Chunks()
    deferred = {f"m{i}": DeferredTensor(tuple(t.shape), t.dtype, source, 7, key)
                for i, (key, t) in enumerate(chunk.items())}  # fmt: skip
    step = torch.tensor(4.0)
    record = write_tensors(tmp_path, "t.safetensors", {"step": step, **deferred}, {"format": "pt"})
    assert reads == [7]
    expected = {"step": step, "m0": chunk[(0, "exp_avg")], "m1": chunk[(1, "exp_avg")]}
    with safe_open(tmp_path / "t.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, t in expected.items():
            assert torch.equal(f.get_tensor(name), t), name
    assert record["tensors"] == {name: tensor_crc(t) for name, t in expected.items()}
