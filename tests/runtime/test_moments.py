"""Adam's moments in each state dtype (fxstar/runtime/moments.py): the bytes a chunk's take,
the views a buffer holds them in (an 8-bit moment's blocks start at each parameter), torch's
quantisation against the C++ core's, an accelerator's update against the C++ kernel's, and
loading from another state dtype."""

from dataclasses import dataclass

import pytest
import torch

from fxstar import _C
from fxstar.runtime import cpu_adam
from fxstar.runtime.moments import (
    QUANT_BLOCK,
    AdamMoments,
    dequantize,
    moment_bytes,
    quant_blocks,
    torch_quantize,
)

HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw=True)


@dataclass
class Slot:
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


# a chunk of 3 parameters: one of whole blocks, one of a part of a block, one of several and
# a part; 900 of its 1000 elements used
SLOTS = [Slot(0, (2, 256)), Slot(512, (100,)), Slot(612, (3, 96))]
LENGTH = 1000


def test_bytes_per_state_dtype():
    numels = [s.numel for s in SLOTS]
    assert moment_bytes("fp32", LENGTH, numels) == 8 * LENGTH
    assert moment_bytes("bf16", LENGTH, numels) == 4 * LENGTH
    # codes padded to a cache line, then an absmax per block of each parameter: 2 + 1 + 2
    assert quant_blocks(512) == 2 and quant_blocks(100) == 1 and quant_blocks(288) == 2
    assert moment_bytes("8bit", LENGTH, numels) == 2 * 1024 + 2 * 4 * 5
    assert AdamMoments("8bit").bytes_per_element() == 2 + 8 / 256
    with pytest.raises(ValueError, match="state_dtype: one of fp32, bf16, 8bit, not 'int4'"):
        AdamMoments("int4")


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "8bit"])
def test_views_tile_the_buffer_without_overlap(state_dtype):
    moments = AdamMoments(state_dtype)
    nbytes = moments.nbytes(LENGTH, [s.numel for s in SLOTS])
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    views = moments.views(buffer, LENGTH, SLOTS)
    owner = torch.full((nbytes,), -1)
    for i, view in enumerate(views):
        assert set(view) == set(moments.keys)
        for key, tensor in view.items():
            start = tensor.data_ptr() - buffer.data_ptr()
            span = owner[start : start + tensor.numel() * tensor.element_size()]
            assert (span == -1).all(), (i, key)
            span.fill_(i)
            if "absmax" not in key:
                assert tensor.shape == SLOTS[i].shape
            else:
                assert tensor.numel() == quant_blocks(SLOTS[i].numel)


def test_an_8bit_run_joins_only_after_whole_blocks():
    assert AdamMoments("8bit").joins(512) and not AdamMoments("8bit").joins(100)
    assert AdamMoments("bf16").joins(100) and AdamMoments("fp32").joins(100)


def test_a_run_of_8bit_moments_is_its_parameters_moments_back_to_back():
    """One kernel call over the first two slots (the first of whole blocks) gives the bytes
    of one call per slot."""
    moments = AdamMoments("8bit")
    nbytes = moments.nbytes(LENGTH, [s.numel for s in SLOTS])
    gen = torch.Generator().manual_seed(0)
    param, grad = torch.randn(LENGTH, generator=gen), torch.randn(LENGTH, generator=gen)
    joined, apart = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    p_joined, p_apart = param.clone(), param.clone()
    views = moments.views(joined, LENGTH, SLOTS)
    n = SLOTS[0].numel + SLOTS[1].numel
    moments.step(p_joined[:n], grad[:n], moments.run(views[0], n), step=1, **HYPER)
    for slot, view in zip(SLOTS[:2], moments.views(apart, LENGTH, SLOTS)):
        part = slice(slot.offset, slot.offset + slot.numel)
        moments.step(p_apart[part], grad[part], moments.run(view, slot.numel), step=1, **HYPER)
    assert torch.equal(p_joined, p_apart) and torch.equal(joined, apart)


@pytest.mark.parametrize("signed", [True, False])
def test_torch_quantisation_is_the_cores(signed):
    gen = torch.Generator().manual_seed(1)
    n = 5 * QUANT_BLOCK + 17
    values = torch.randn(n, generator=gen) * torch.logspace(-9, 0, n)[torch.randperm(n)]
    values[:QUANT_BLOCK] = 0  # a block of zeros
    if not signed:
        values = values.abs()
    want_codes, want_absmax = torch.empty(n, dtype=torch.uint8), torch.empty(quant_blocks(n))
    _C.quantize_moment(values, want_codes, want_absmax, signed=signed)
    codes, absmax = torch.empty_like(want_codes), torch.empty_like(want_absmax)
    torch_quantize(values, codes, absmax, signed=signed)
    assert torch.equal(codes, want_codes), (codes != want_codes).sum()
    assert torch.equal(absmax, want_absmax)
    back = dequantize(codes, absmax, signed=signed)
    code = torch.tensor(_C.quantization_map(signed=signed))
    assert torch.equal(back, code[codes.long()] * absmax.repeat_interleave(QUANT_BLOCK)[:n])


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "8bit"])
def test_torch_step_follows_the_kernel(state_dtype):
    """The accelerator's update (torch's fused Adam, moments widened and stored back) against
    the C++ kernel, three steps on the host: the same moments but for a last ulp (torch's
    sqrt), and so the same codes but where a value sits on a code's boundary."""
    moments = AdamMoments(state_dtype)
    n = 3 * QUANT_BLOCK + 40
    slots = [Slot(0, (n,))]
    gen = torch.Generator().manual_seed(2)
    param = torch.randn(n, generator=gen)
    kernel, fused = param.clone(), param.clone()
    buffers = [torch.zeros(moments.nbytes(n, [n]), dtype=torch.uint8) for _ in range(2)]
    by_kernel, by_torch = (moments.views(b, n, slots)[0] for b in buffers)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen) * 0.1
        moments.step(kernel, grad, moments.run(by_kernel, n), step=step, **HYPER)
        moments.torch_step(fused, grad, moments.run(by_torch, n), torch.tensor(float(step)),
                           **HYPER)  # fmt: skip
    torch.testing.assert_close(fused, kernel, rtol=1e-6, atol=1e-7)
    for got, want in zip(moments.values(by_torch), moments.values(by_kernel)):
        torch.testing.assert_close(got, want, rtol=0.02 if moments.quantised else 1e-2, atol=1e-6)
    if moments.quantised:
        agree = (by_torch["exp_avg_codes"] == by_kernel["exp_avg_codes"]).float().mean()
        assert agree > 0.99


def moments_of(state_dtype: str, m: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """A state entry of `state_dtype` holding these values (as that format stores them)."""
    target = AdamMoments(state_dtype)
    n = m.numel()
    view = target.views(torch.zeros(target.nbytes(n, [n]), dtype=torch.uint8), n,
                        [Slot(0, tuple(m.shape))])[0]  # fmt: skip
    target.load(view, {"exp_avg": m, "exp_avg_sq": v})
    return view


@pytest.mark.parametrize("into", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("saved", ["fp32", "bf16", "8bit"])
def test_loading_converts_from_any_state_dtype(saved, into):
    """In the same format: bitwise. From another: its fp32 values, stored as `into` stores
    them (rounded to bf16 by torch's copy, quantised by the core)."""
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(4, 100, generator=gen) * 1e-3
    v = torch.rand(4, 100, generator=gen) * 1e-6
    source = moments_of(saved, m, v)
    target = moments_of(into, torch.zeros_like(m), torch.zeros_like(v))
    AdamMoments(into).load(target, source)
    if saved == into:
        for key in source:
            assert torch.equal(target[key], source[key]), key
        return
    want = moments_of(into, *(x.view(4, 100) for x in AdamMoments(saved).values(source)))
    for key in want:
        assert torch.equal(target[key], want[key]), key


def test_loading_without_moments_names_what_it_found():
    target = moments_of("8bit", torch.zeros(300), torch.zeros(300))
    with pytest.raises(KeyError, match="no Adam moments among the saved state's \\['step'\\]"):
        AdamMoments("8bit").load(target, {"step": torch.tensor(1.0)})


def test_fresh_moments_of_a_parameter_are_zero_and_its_own():
    param = torch.randn(3, 300)
    for state_dtype in ("fp32", "bf16", "8bit"):
        fresh = AdamMoments(state_dtype).fresh(param)
        first, second = AdamMoments(state_dtype).values(fresh)
        assert first.numel() == 900 and not first.any() and not second.any()
    assert AdamMoments("8bit").fresh(param)["exp_avg_absmax"].numel() == 4


def test_the_8bit_wrapper_checks_its_buffers():
    p, g = torch.zeros(300), torch.zeros(300)
    codes, absmax = torch.zeros(300, dtype=torch.uint8), torch.zeros(1)
    with pytest.raises(ValueError, match="exp_avg_absmax: has 1 elements but 300 values make 2"):
        cpu_adam.adam_step_8bit(p, g, codes, absmax, codes.clone(), torch.zeros(2), step=1,
                                lr=1e-3)  # fmt: skip
