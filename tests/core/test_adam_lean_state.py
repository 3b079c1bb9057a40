"""The C++ Adam with leaner moments against a Python reference of the same arithmetic: bf16
moments (fp32 master) and 8-bit blockwise-quantised moments (bitsandbytes' dynamic map), with
the fused unscale (grad_scale) and low-precision copy-out of the fp32 kernel."""

from __future__ import annotations

import math

import pytest
import torch

from fxstar import _C

BLOCK = _C.QUANT_BLOCK
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fused multiply-add: the product is exact in float64."""
    return (a.double() * b.double() + c.double()).float()


def reference_update(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw, scale):
    """The kernel's fp32 update (csrc/kernels/kernel_body.inl) in torch: new p, m, v."""
    f = torch.float32
    neg_step_size = torch.tensor(-lr / (1 - beta1**step), dtype=f)
    bias2_sqrt = torch.tensor(math.sqrt(1 - beta2**step), dtype=f)
    weight1 = torch.tensor(1 - beta1, dtype=f)
    b2, one_minus_b2 = torch.tensor(beta2, dtype=f), torch.tensor(1 - beta2, dtype=f)
    gi = g.float() * torch.tensor(scale, dtype=f)
    if adamw:
        p = p * torch.tensor(1 - lr * weight_decay, dtype=f)
    else:
        gi = gi + torch.tensor(weight_decay, dtype=f) * p
    if weight1 < 0.5:
        m = fma(weight1.expand_as(gi), gi - m, m)
    else:
        m = fma((weight1 - 1).expand_as(gi), gi - m, gi)
    v = fma(one_minus_b2 * gi, gi, v * b2)
    denom = torch.sqrt(v) / bias2_sqrt + torch.tensor(eps, dtype=f)
    return p + neg_step_size * m / denom, m, v


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within a few float32 ulps: the reference's fused multiply-adds round twice (through
    float64), which moves a moment by an ulp now and then, and a parameter with it."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-8)


def maps() -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(_C.quantization_map(signed=True)),
        torch.tensor(_C.quantization_map(signed=False)),
    )


def per_element(absmax: torch.Tensor, n: int) -> torch.Tensor:
    return absmax.repeat_interleave(BLOCK)[:n]


def reference_quantize(x: torch.Tensor, code: torch.Tensor, signed: bool):
    """codes, absmax of x: the nearest code of x / its block's absmax (a tie to the lower),
    a signed code never of the other sign than x."""
    n = x.numel()
    padded = torch.zeros(-(-n // BLOCK) * BLOCK)
    padded[:n] = x.abs()
    absmax = padded.view(-1, BLOCK).amax(1)
    divisor = per_element(torch.where(absmax > 0, absmax, torch.ones_like(absmax)), n)
    scaled = x / divisor
    mids = (code[:-1] + code[1:]) * 0.5
    idx = torch.bucketize(scaled, mids)
    if signed:
        idx = torch.where((scaled < 0) & (code[idx] >= 0), idx - 1, idx)
        idx = torch.where((scaled > 0) & (code[idx] < 0), idx + 1, idx)
    return idx.to(torch.uint8), absmax


def state(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 0.01
    m = torch.randn(n, generator=gen) * 0.01
    v = torch.rand(n, generator=gen) * 1e-4
    return p, g, m, v


def test_the_maps_are_bitsandbytes_dynamic_maps():
    signed, unsigned = maps()
    for code in (signed, unsigned):
        assert code.numel() == 256 and torch.all(code[1:] > code[:-1])
        assert code.max() == 1.0 and (code == 0).sum() == 1
    # 127 codes a side for a first moment; 254 positive ones for a second, down to ~1e-7
    assert (signed < 0).sum() == 127 and (signed > 0).sum() == 128
    assert unsigned.min() == 0 and 1e-7 < unsigned[1] < 1e-6
    assert torch.isclose(signed[0], torch.tensor(-(0.1 + 0.9 * 63.5 / 64)))


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("step", [1, 7])
def test_bf16_moments_match_the_reference(adamw, step):
    n = 3 * 4096 + 5
    p, g, m, v = state(n, seed=1)
    m16, v16 = m.bfloat16(), v.bfloat16()
    kw = dict(HYPER, step=step, adamw=adamw)
    want_p, want_m, want_v = reference_update(
        p.clone(), g, m16.float(), v16.float(), scale=1.0, **kw
    )
    _C.adam_step(p, g, m16, v16, grad_scale=1.0, num_threads=2, **kw)
    assert_near(p, want_p)
    # stored rounded to nearest even; a last-ulp difference of the fp32 value may flip that
    for got, want in ((m16, want_m.bfloat16()), (v16, want_v.bfloat16())):
        assert (got == want).float().mean() > 0.999
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)


def test_bf16_moments_with_unscale_and_copy_out_in_place():
    n = 5000
    p, g, m, v = state(n, seed=2)
    g16 = (g * 1024).bfloat16()  # a loss-scaled bf16 gradient, its copy-out into itself
    m16, v16 = m.bfloat16(), v.bfloat16()
    kw = dict(HYPER, step=3, adamw=True)
    want_p, _, _ = reference_update(p.clone(), g16, m16.float(), v16.float(), scale=1 / 1024, **kw)
    _C.adam_step(p, g16, m16, v16, grad_scale=1 / 1024, out=g16, num_threads=1, **kw)
    assert_near(p, want_p)
    assert torch.equal(g16, p.bfloat16())


def test_fp32_and_bf16_moments_are_not_mixed():
    p, g, m, v = state(64, seed=3)
    with pytest.raises(TypeError, match="both moments must be float32 or both bfloat16"):
        _C.adam_step(p, g, m.bfloat16(), v, step=1, adamw=True, num_threads=1, **HYPER)


def quantised(m: torch.Tensor, v: torch.Tensor):
    mc, ma = torch.empty(m.numel(), dtype=torch.uint8), torch.empty(-(-m.numel() // BLOCK))
    vc, va = torch.empty_like(mc), torch.empty_like(ma)
    _C.quantize_moment(m, mc, ma, signed=True)
    _C.quantize_moment(v, vc, va, signed=False)
    return mc, ma, vc, va


def test_quantize_moment_matches_the_reference_and_round_trips():
    signed, unsigned = maps()
    _, _, m, v = state(4 * BLOCK + 17, seed=4)
    m[:BLOCK] = 0  # an all-zero block
    m[BLOCK + 3] = -1e-12  # tiny negatives keep their sign
    mc, ma, vc, va = quantised(m, v)
    for x, c, a, code, signed_ in ((m, mc, ma, signed, True), (v, vc, va, unsigned, False)):
        want_c, want_a = reference_quantize(x, code, signed_)
        assert torch.equal(c, want_c) and torch.equal(a, want_a)
        back = torch.empty_like(x)
        _C.dequantize_moment(c, a, back, signed=signed_)
        assert torch.equal(back, code[c.long()] * per_element(a, x.numel()))
        # within half the widest gap of the map, relative to the block's largest value
        assert torch.all((back - x).abs() <= per_element(a, x.numel()) * 0.5 * 0.0141)
    back = torch.empty_like(m)
    _C.dequantize_moment(mc, ma, back, signed=True)
    assert torch.all(back[:BLOCK] == 0) and back[BLOCK + 3] < 0
    assert torch.all(torch.sign(back) * torch.sign(m) >= 0)


def neighbours(x: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    """x and the `ulps` float32 values either side of each."""
    bits = x.view(torch.int32)
    return torch.cat([(bits + k).view(torch.float32) for k in range(-ulps, ulps + 1)])


@pytest.mark.parametrize("signed", [True, False])
def test_the_nearest_code_at_and_beside_every_boundary(signed):
    """The core finds a code from the value's bits (a bucket's first code and one comparison);
    at each decision boundary, its float neighbours, every bucket's edges of 1/256 binade
    (both signs) and the smallest magnitudes, it is the reference's binary search. Each block
    holds a 1 so the values are quantised as they are."""
    code = maps()[0 if signed else 1]
    mids = (code[:-1] + code[1:]) * 0.5
    edges = torch.arange(0x33800000, 0x3F800001, 1 << 15, dtype=torch.int32).view(torch.float32)
    tiny = torch.tensor([0.0, 1e-45, 1e-30, 2.0**-24, 1e-7, 3e-7])
    x = torch.cat([neighbours(mids.abs()), neighbours(edges, 1), tiny])
    x = x[(x >= 0) & (x <= 1)]
    if signed:
        x = torch.cat([x, -x, torch.tensor([-0.0])])
    x = torch.nn.functional.pad(x, (0, -x.numel() % (BLOCK - 1))).view(-1, BLOCK - 1)
    x = torch.cat([torch.ones(x.shape[0], 1), x], dim=1).reshape(-1)
    codes, absmax = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(x.numel() // BLOCK)
    _C.quantize_moment(x, codes, absmax, signed=signed)
    want, _ = reference_quantize(x, code, signed)
    assert torch.equal(absmax, torch.ones_like(absmax))
    assert torch.equal(codes, want), x[codes != want][:8]


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_8bit_moments_match_the_reference(adamw, grad_dtype):
    signed, unsigned = maps()
    n = 7 * BLOCK + 100  # several threads' ranges and a partial last block
    p, g, m, v = state(n, seed=5)
    g = (g * 64).to(grad_dtype)
    mc, ma, vc, va = quantised(m, v)
    m_in = signed[mc.long()] * per_element(ma, n)
    v_in = unsigned[vc.long()] * per_element(va, n)
    kw = dict(HYPER, step=5, adamw=adamw)
    want_p, want_m, want_v = reference_update(p.clone(), g, m_in, v_in, scale=1 / 64, **kw)
    want_mc, want_ma = reference_quantize(want_m, signed, True)
    want_vc, want_va = reference_quantize(want_v, unsigned, False)
    out = torch.empty(n, dtype=torch.bfloat16)
    _C.adam_step_8bit(p, g, mc, ma, vc, va, grad_scale=1 / 64, out=out, num_threads=3, **kw)
    assert_near(p, want_p)
    assert torch.equal(out, p.bfloat16())
    torch.testing.assert_close(ma, want_ma, rtol=2e-7, atol=0)
    torch.testing.assert_close(va, want_va, rtol=2e-7, atol=0)
    # a last-ulp difference of a moment may move it across a boundary: one code at most
    for got, want in ((mc, want_mc), (vc, want_vc)):
        differ = got.int() - want.int()
        assert differ.abs().max() <= 1 and (differ != 0).float().mean() < 1e-3


def test_8bit_moments_start_from_zero():
    n = 1000
    p, g, _, _ = state(n, seed=6)
    mc, vc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ma, va = torch.zeros(-(-n // BLOCK)), torch.zeros(-(-n // BLOCK))
    p32, m32, v32 = p.clone(), torch.zeros(n), torch.zeros(n)
    kw = dict(HYPER, step=1, adamw=True)
    _C.adam_step_8bit(p, g, mc, ma, vc, va, num_threads=1, **kw)
    _C.adam_step(p32, g, m32, v32, num_threads=1, **kw)
    torch.testing.assert_close(p, p32, rtol=1e-6, atol=0)  # step 1 reads zeros either way


def train(kind: str, steps: int) -> float:
    """Adam on a noisy quadratic with moments of `kind`; the final loss."""
    gen = torch.Generator().manual_seed(7)
    n = 8192
    target = torch.randn(n, generator=gen)
    curvature = torch.rand(n, generator=gen) * 10 + 0.1
    p = torch.zeros(n)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    m16, v16 = m32.bfloat16(), v32.bfloat16()
    mc, vc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ma, va = torch.zeros(n // BLOCK), torch.zeros(n // BLOCK)
    for step in range(1, steps + 1):
        g = 2 * curvature * (p - target) + torch.randn(n, generator=gen) * 0.1
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step)
        if kind == "fp32":
            _C.adam_step(p, g, m32, v32, adamw=True, num_threads=2, **kw)
        elif kind == "bf16":
            _C.adam_step(p, g, m16, v16, adamw=True, num_threads=2, **kw)
        else:
            _C.adam_step_8bit(p, g, mc, ma, vc, va, adamw=True, num_threads=2, **kw)
    return float((curvature * (p - target) ** 2).mean())


def test_lean_moments_train_as_fp32_moments_do():
    start = train("fp32", 0)
    fp32 = train("fp32", 300)
    assert fp32 < start / 100
    for kind in ("bf16", "8bit"):
        assert abs(train(kind, 300) - fp32) < 0.05 * fp32 + 1e-3 * start, kind


def test_8bit_arguments_are_checked():
    n = 300
    p, g, m, v = state(n, seed=8)
    mc, ma, vc, va = quantised(m, v)
    kw = dict(HYPER, step=1, adamw=True, num_threads=1)
    cases = [
        (dict(exp_avg_codes=mc.to(torch.int8)), TypeError, "exp_avg_codes: dtype int8"),
        (dict(exp_avg_codes=mc[:-1]), ValueError, "exp_avg_codes: has 299"),
        (dict(exp_avg_sq_absmax=va[:1]), ValueError, "exp_avg_sq_absmax: has 1 .* 2 blocks"),
        (dict(exp_avg_absmax=ma.double()), TypeError, "exp_avg_absmax: unsupported dtype"),
        (dict(exp_avg_sq_codes=mc), ValueError, "exp_avg_codes and exp_avg_sq_codes overlap"),
        (dict(param=p.bfloat16()), TypeError, "param: dtype bfloat16"),
        (dict(grad=g[:10]), ValueError, "grad: has 10"),
        (dict(exp_avg_codes=torch.zeros(2 * n, dtype=torch.uint8)[::2]), ValueError, "contig"),
    ]
    for change, error, match in cases:
        args = dict(
            param=p,
            grad=g,
            exp_avg_codes=mc,
            exp_avg_absmax=ma,
            exp_avg_sq_codes=vc,
            exp_avg_sq_absmax=va,
        )
        args.update(change)
        with pytest.raises(error, match=match):
            _C.adam_step_8bit(**args, **kw)
    with pytest.raises(ValueError, match="lr: must be"):
        _C.adam_step_8bit(p, g, mc, ma, vc, va, **dict(kw, lr=float("nan")))
    with pytest.raises(ValueError, match="a second moment is never negative"):
        _C.quantize_moment(-v, vc, va, signed=False)
