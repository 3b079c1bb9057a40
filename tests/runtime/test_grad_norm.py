"""The clip rule both optimizer paths take (runtime/grad_norm.py): torch's clip_grad_norm_
coefficient, as a float for HybridAdam's fused step and in torch's own float32 arithmetic for a
torch optimizer's gradients."""

import math

import pytest
import torch

from fxstar.runtime.grad_norm import GradNorm, clip_coefficient


def test_the_float_coefficient_is_torchs_rule():
    assert clip_coefficient(1.0, 0.5) == 1.0  # never scaled up
    assert clip_coefficient(1.0, 4.0) == 1.0 / (4.0 + 1e-6)
    assert clip_coefficient(0.05, 0.05) == 0.05 / (0.05 + 1e-6)  # the guard: just below 1


def test_a_tensor_norm_gives_a_float32_tensor_clamped_at_one():
    below = clip_coefficient(1.0, torch.tensor(0.5))
    above = clip_coefficient(1.0, torch.tensor(3.0))
    assert below.dtype == above.dtype == torch.float32
    assert float(below) == 1.0
    assert torch.equal(above, torch.clamp(1.0 / (torch.tensor(3.0) + 1e-6), max=1.0))


def gradients(seed: int, dtypes: tuple[torch.dtype, ...]) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape, dtype in zip([(7, 5), (3,), (11, 2)], dtypes):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=generator) * 10.0 ** (seed % 5 - 2)).to(dtype)
        params.append(p)
    return params


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3,
                                    (torch.float32, torch.bfloat16, torch.float32)],
                         ids=["fp32", "mixed"])  # fmt: skip
@pytest.mark.parametrize("max_norm", [1e-3, 0.05, 1.0, 1e3])
def test_clip_is_torchs_clip_by_the_float64_norm_bit_for_bit(dtypes, max_norm):
    """GradNorm.clip_ multiplies as torch.nn.utils.clip_grads_with_norm_ does, by the norm
    summed in float64 (whether clipping acted or not)."""
    for seed in range(10):
        ours, reference = gradients(seed, dtypes), gradients(seed, dtypes)
        sum_sq = sum(float(torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2)
                     for p in reference)  # fmt: skip
        torch.nn.utils.clip_grads_with_norm_(reference, max_norm, torch.tensor(sum_sq**0.5))
        GradNorm().clip_(ours, max_norm)
        for got, want in zip(ours, reference, strict=True):
            assert torch.equal(got.grad, want.grad)
        changed = any(not torch.equal(p.grad, q.grad) for p, q in
                      zip(ours, gradients(seed, dtypes), strict=True))  # fmt: skip
        assert changed == (max_norm < math.sqrt(sum_sq))


def test_clip_leaves_parameters_without_gradients():
    params = gradients(0, (torch.float32,) * 3)
    params[1].grad = None
    GradNorm().clip_(params, 1e-3)
    assert params[1].grad is None
    total = math.sqrt(sum(float(p.grad.double().norm() ** 2) for p in params if p.grad is not None))
    assert total == pytest.approx(1e-3, rel=1e-4)
