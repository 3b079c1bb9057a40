"""Aligned host buffers seen by torch without a copy."""

import gc
import inspect

import pytest
import torch

from fxstar import _C
from fxstar.runtime.host import host_empty


def test_torch_sees_the_same_memory():
    buffer = _C.HostBuffer(10_000, 4096, True)
    tensor = torch.from_dlpack(buffer)
    assert tensor.dtype == torch.uint8 and tensor.shape == (10_000,)
    assert tensor.data_ptr() == buffer.address
    assert buffer.address % 4096 == 0
    assert int(tensor.sum()) == 0
    tensor.fill_(7)
    assert int(torch.from_dlpack(buffer).sum()) == 7 * 10_000  # a second view, same bytes


def test_memory_outlives_the_buffer_object():
    tensor = torch.from_dlpack(_C.HostBuffer(1 << 20, 0, False))
    gc.collect()
    tensor.fill_(1)
    assert int(tensor.sum()) == 1 << 20


def test_large_buffers_are_huge_page_aligned():
    buffer = _C.HostBuffer(64 << 20, 0, False)
    assert buffer.alignment == 2 << 20 and buffer.address % (2 << 20) == 0


def test_host_empty_views_as_any_dtype():
    t = host_empty(4096, zero=True).view(torch.float32)
    assert t.numel() == 1024 and t.abs().sum() == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="nbytes"):
        _C.HostBuffer(-1, 0, False)
    with pytest.raises(ValueError, match="alignment"):
        _C.HostBuffer(16, 3000, False)
    assert torch.from_dlpack(_C.HostBuffer(0, 0, False)).numel() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_pinning_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        host_empty(16, pin=True)


def test_buffers_are_zeroed_unless_asked_not_to():
    # zero=False shows what the heap held before; the defaults must never do that
    assert inspect.signature(host_empty).parameters["zero"].default is True
    for _ in range(20):  # a freed block of this size is handed out again at once
        dirty = _C.HostBuffer(4096, 64, False)
        torch.from_dlpack(dirty).fill_(0xAB)
        del dirty
        assert int(torch.from_dlpack(_C.HostBuffer(4096, 64)).count_nonzero()) == 0
        assert int(host_empty(4096, alignment=64).count_nonzero()) == 0
    assert "zero=False" in _C.HostBuffer.__doc__ and "heap" in _C.HostBuffer.__doc__
