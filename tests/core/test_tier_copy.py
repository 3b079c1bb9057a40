"""The core's copy between host buffers, and the helper every chunk move goes through."""

import pytest
import torch

from fxstar import _C
from fxstar.runtime import tier_copy
from fxstar.runtime.host import host_empty

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 4097, (3 << 20) + 5, (9 << 20) + 1])
@pytest.mark.parametrize("threads", [1, 2, 64])
def test_copy_into_is_bitwise(dtype, numel, threads):
    src = torch.randn(numel).to(dtype)
    src[0] = float("nan")
    src[-1] = -0.0
    dst = torch.full((numel,), 7.0, dtype=dtype)
    _C.copy_into(dst, src, num_threads=threads)
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # NaN and -0.0 compared too
    assert torch.equal(dst.view(bits), src.view(bits))


def test_copy_into_between_offsets_of_host_buffers():
    """A chunk's host home into an arena block: views at byte offsets of larger buffers."""
    home = host_empty(64 << 20).view(torch.float32)
    arena = host_empty(96 << 20)
    home.copy_(torch.arange(home.numel(), dtype=torch.float32))
    block = arena[4096 : 4096 + home.nbytes].view(torch.float32)
    _C.copy_into(block, home, num_threads=2)
    assert torch.equal(block, home)
    assert int(arena[:4096].count_nonzero()) == 0
    assert int(arena[4096 + home.nbytes :].count_nonzero()) == 0


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda a, b: (b, a[::2]), ValueError, "src: must be contiguous"),
        (lambda a, b: (b.t(), a), ValueError, "dst: must be contiguous"),
        (lambda a, b: (b[:-1], a), ValueError, "must match"),
        (lambda a, b: (b.half(), a), TypeError, "dtypes differ"),
        (lambda a, b: (a, a), ValueError, "overlap"),
        (lambda a, b: (a[1:], a[:-1]), ValueError, "overlap"),
        (lambda a, b: (b.long(), a.long()), TypeError, "unsupported dtype"),
        (lambda a, b: (b, None), TypeError, "src: expected a tensor"),
        (lambda a, b: (b, [1.0, 2.0]), TypeError, "src: expected a tensor"),
    ],
)
def test_copy_into_refuses_what_it_cannot_copy(make, error, words):
    a, b = torch.randn(64, 64), torch.zeros(64, 64)
    dst, src = make(a, b)
    with pytest.raises(error, match=words):
        _C.copy_into(dst, src, num_threads=2)


def test_copy_into_refuses_bad_thread_counts_and_meta_tensors():
    a, b = torch.randn(8), torch.zeros(8)
    with pytest.raises(ValueError, match="num_threads"):
        _C.copy_into(b, a, num_threads=0)
    _C.copy_into(b, a, num_threads=10**9)  # clamped, as the Adam kernels do
    assert torch.equal(a, b)
    with pytest.raises((TypeError, ValueError)):
        _C.copy_into(torch.empty(8, device="meta"), a, num_threads=1)


def test_copy_into_empty_is_a_no_op():
    _C.copy_into(torch.empty(0), torch.empty(0), num_threads=2)


@pytest.mark.parametrize(
    "dst, src, core",
    [
        (torch.empty(1 << 16), torch.randn(1 << 16), True),
        (torch.empty(16), torch.randn(16), False),  # small: torch's copy_
        (torch.empty(1 << 16, dtype=torch.bfloat16), torch.randn(1 << 16), False),  # converts
        (torch.empty(256, 256), torch.randn(256, 256).t(), False),  # strided
        (torch.empty(256, 256), torch.randn(256), False),  # broadcast
    ],
)
def test_copy_payload_takes_the_core_only_where_it_copies_alike(dst, src, core):
    assert tier_copy.core_copyable(dst, src) is core
    tier_copy.copy_payload(dst, src)
    assert torch.equal(dst, src.to(dst.dtype).expand_as(dst))


def test_copy_payload_of_leaves_that_require_grad():
    src = torch.randn(1 << 16, requires_grad=True)
    dst = torch.zeros(1 << 16)
    tier_copy.copy_payload(dst, src)
    assert torch.equal(dst, src.detach())


@pytest.mark.parametrize("threads", [1, 3])
def test_streaming_copy_at_unaligned_offsets(threads):
    """From 8 MiB on the copy streams, a cache line at a time: a destination that starts and
    ends off a line boundary gets its head and tail copied too, and nothing beside it."""
    numel = (9 << 20) + 7  # bf16: 18 MiB and 14 bytes
    src = torch.randn(numel + 3).to(torch.bfloat16)[3:]
    room = torch.zeros(numel + 2, dtype=torch.bfloat16)
    dst = room[1:-1]
    _C.copy_into(dst, src, num_threads=threads)
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
    assert room[0] == 0 and room[-1] == 0
