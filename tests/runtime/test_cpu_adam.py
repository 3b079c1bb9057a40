"""The C++ CPU Adam against torch.optim, and its argument checks."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from fxstar import _C
from fxstar.runtime import cpu_adam

SIZES = [1, 7, 1023, 4096 + 3, 1 << 20]
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)


def norm_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert norm_relative_error(actual, expected) <= 1e-6


def run_both(n, *, adamw, steps=50, grad_dtype=torch.float32, grad_scale=1.0, variant=None):
    """fxstar and torch.optim over the same gradients; returns both (param, exp_avg, exp_avg_sq)."""
    gen = torch.Generator().manual_seed(n)
    param = torch.randn(n, generator=gen)
    reference = param.clone().requires_grad_(True)
    optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)([reference], **HYPER)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        cpu_adam.adam_step(
            param,
            grad / grad_scale if grad_scale != 1.0 else grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            adamw=adamw,
            grad_scale=grad_scale,
            variant=variant,
            **HYPER,
        )
        reference.grad = grad.float()
        optimizer.step()
    state = optimizer.state[reference]
    return (param, exp_avg, exp_avg_sq), (reference.detach(), state["exp_avg"], state["exp_avg_sq"])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_fp32_matches_torch_over_50_steps(n, adamw):
    ours, theirs = run_both(n, adamw=adamw)
    for a, b in zip(ours, theirs):
        assert_matches(a, b)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [7, 4096 + 3])
def test_low_precision_gradients_read_directly(grad_dtype, n):
    ours, theirs = run_both(n, adamw=True, steps=20, grad_dtype=grad_dtype)
    for a, b in zip(ours, theirs):
        assert_matches(a, b)


def test_grad_scale_is_applied_first():
    # Gradients arrive multiplied by a loss scale of 1024; grad_scale=1/1024 undoes it exactly.
    ours, theirs = run_both(1023, adamw=False, steps=10, grad_scale=1 / 1024)
    for a, b in zip(ours, theirs):
        assert_matches(a, b)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_copy_equals_master_cast(out_dtype):
    n = 4096 + 3
    param, grad = torch.randn(n) * 100, torch.randn(n)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    cpu_adam.adam_step(param, grad, exp_avg, exp_avg_sq, step=1, out=out, **HYPER)
    assert torch.equal(out, param.to(out_dtype))


@pytest.mark.parametrize("variant", cpu_adam.available_variants())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_copy_may_overwrite_its_own_gradient(dtype, variant):
    """A bf16/fp16 gradient in its parameters' room: out is grad itself, and the update is
    the one separate buffers give (every block's gradients are read before they are written)."""
    n = 3 * 2048 + 5  # the copy loop's blocks, and a ragged end
    master = torch.randn(n) * 10
    grad = torch.randn(n).to(dtype)
    results = []
    for in_place in (False, True):
        param, exp_avg, exp_avg_sq = master.clone(), torch.zeros(n), torch.zeros(n)
        g = grad.clone()
        out = g if in_place else torch.empty(n, dtype=dtype)
        cpu_adam.adam_step(param, g, exp_avg, exp_avg_sq, step=1, out=out, grad_scale=0.5,
                           variant=variant, **HYPER)  # fmt: skip
        results.append((param, exp_avg, exp_avg_sq, out))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(results[1][3], results[1][0].to(dtype))


@pytest.mark.parametrize("variant", cpu_adam.available_variants())
def test_every_available_variant_matches_torch(variant):
    ours, theirs = run_both(4096 + 3, adamw=True, steps=10, variant=variant)
    for a, b in zip(ours, theirs):
        assert_matches(a, b)
    grad = torch.randn(10_001)
    assert cpu_adam.grad_stats(grad, variant=variant).sum_sq == pytest.approx(
        float(grad.double().square().sum()), rel=1e-12
    )


def test_default_variant_is_the_best_available():
    assert cpu_adam.selected_variant() == cpu_adam.available_variants()[0]
    assert cpu_adam.available_variants()[-1] == "portable"


def test_variant_can_be_forced_from_the_environment():
    code = "from fxstar.runtime import cpu_adam; print(cpu_adam.selected_variant())"
    env = dict(os.environ, FXSTAR_CPU_VARIANT="portable")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.stdout.strip() == "portable", result.stderr


def test_unknown_variant_is_refused():
    valid = ", ".join(cpu_adam.available_variants())
    with pytest.raises(ValueError, match=f"'avx9000' is not a kernel variant; valid on this CPU: "
                       f"{valid}$"):  # fmt: skip
        cpu_adam.grad_stats(torch.ones(3), variant="avx9000")


BOGUS_VARIANT = """
import torch
from fxstar.runtime import cpu_adam
for call in (cpu_adam.selected_variant, lambda: cpu_adam.grad_stats(torch.ones(3))):
    try:
        call()
    except ValueError as error:
        print("refused:", error)
print("named:", cpu_adam.grad_stats(torch.ones(3), variant="portable").sum_sq)
"""


def test_unknown_variant_in_the_environment_is_refused():
    # was: silently the best variant (AVX-512 here), so a typo went unnoticed
    env = dict(os.environ, FXSTAR_CPU_VARIANT="bogus")
    run = subprocess.run([sys.executable, "-c", BOGUS_VARIANT], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    valid = ", ".join(cpu_adam.available_variants())
    message = (
        f"refused: FXSTAR_CPU_VARIANT: 'bogus' is not a kernel variant; valid on this CPU: "
        f"{valid} (unset it to choose the best automatically)"
    )
    # every call that would use the default refuses, not only the first; a named one still works
    assert run.stdout.splitlines() == [message, message, "named: 3.0"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_stats_matches_torch(dtype):
    grad = torch.randn(100_003).to(dtype)
    stats = cpu_adam.grad_stats(grad)
    assert stats.finite
    assert stats.sum_sq == pytest.approx(float(grad.double().square().sum()), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 50_000, 100_002])
def test_grad_stats_finds_a_planted_non_finite(dtype, bad, where):
    grad = torch.randn(100_003).to(dtype)
    grad[where] = bad
    assert not cpu_adam.grad_stats(grad).finite


def test_grad_stats_large_finite_values_stay_finite():
    # Their squares overflow float32 but not the double accumulator.
    grad = torch.full((1000,), 3e38)
    stats = cpu_adam.grad_stats(grad)
    assert stats.finite and stats.sum_sq == pytest.approx(1000 * 9e76, rel=1e-6)


def test_two_threads_stepping_different_buffers():
    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(1 << 18, generator=gen) for _ in range(2)] + [
            torch.zeros(1 << 18),
            torch.zeros(1 << 18),
        ]

    def train(buffers):
        param, grad, m, v = buffers
        for step in range(1, 21):
            cpu_adam.adam_step(param, grad, m, v, step=step, **HYPER)

    sequential = [make(1), make(2)]
    for b in sequential:
        train(b)
    concurrent = [make(1), make(2)]
    threads = [threading.Thread(target=train, args=(b,)) for b in concurrent]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seq, conc in zip(sequential, concurrent):
        for a, b in zip(seq, conc):
            assert torch.equal(a, b)


def test_tensors_that_require_grad_are_taken_by_their_data():
    param = torch.randn(8, requires_grad=True)
    before = param.detach().clone()
    cpu_adam.adam_step(param, torch.ones(8), torch.zeros(8), torch.zeros(8), step=1, **HYPER)
    assert not torch.equal(param.detach(), before)


# --- errors: every bad call raises a Python exception that names the argument ---------------


def call(param=None, grad=None, exp_avg=None, exp_avg_sq=None, **overrides):
    n = 16
    kwargs = dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        step=1,
        adamw=True,
        num_threads=1,
    )
    kwargs.update(overrides)
    _C.adam_step(
        torch.zeros(n) if param is None else param,
        torch.zeros(n) if grad is None else grad,
        torch.zeros(n) if exp_avg is None else exp_avg,
        torch.zeros(n) if exp_avg_sq is None else exp_avg_sq,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(param=torch.zeros(16, dtype=torch.float64)), TypeError, "param: .*float64"),
        (dict(exp_avg=torch.zeros(16, dtype=torch.bfloat16)), TypeError, "exp_avg: dtype"),
        (dict(grad=torch.zeros(16, dtype=torch.int32)), TypeError, "grad: unsupported dtype"),
        (dict(grad=torch.zeros(15)), ValueError, "grad: has 15 elements"),
        (dict(exp_avg_sq=torch.zeros(17)), ValueError, "exp_avg_sq: has 17 elements"),
        (dict(param=torch.zeros(32)[::2]), ValueError, "param: must be contiguous"),
        (dict(grad=torch.zeros(4, 8).t()), ValueError, "grad: must be contiguous"),
        (dict(param=torch.zeros(16, requires_grad=True)), TypeError, "param: could not be"),
        (dict(grad="zeros"), TypeError, "grad: expected a tensor"),
        (dict(out=torch.zeros(16)), TypeError, "out: dtype float32"),
        (dict(out=torch.zeros(8, dtype=torch.bfloat16)), ValueError, "out: has 8"),
        (dict(step=0), ValueError, "step"),
        (dict(beta1=1.0), ValueError, "beta1"),
        (dict(beta2=-0.1), ValueError, "beta2"),
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(lr=float("nan")), ValueError, "lr"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(grad_scale=float("inf")), ValueError, "grad_scale"),
        (dict(num_threads=0), ValueError, "num_threads"),
        (dict(num_threads=-5), ValueError, "num_threads: must be at least 1, got -5"),
        (dict(variant="nope"), ValueError, "variant"),
        # hyperparameters that would give NaN parameters
        (dict(eps=0.0), ValueError, "eps: must be a finite float32 >= 1.17549e-38, got 0"),
        (dict(eps=1e-45), ValueError, "eps: must be"),  # 0 in float32 (or flushed to it)
        (dict(eps=float("inf")), ValueError, "eps: must be"),
        (dict(lr=1e300), ValueError, "lr: must be a finite float32"),  # inf in float32
        (dict(lr=float("inf")), ValueError, "lr: must be a finite float32"),
        (dict(beta1=float("nan")), ValueError, "beta1"),
        (dict(weight_decay=float("inf")), ValueError, "weight_decay: must be a finite float32"),
        (dict(grad_scale=1e300), ValueError, "grad_scale: must be a finite float32"),
    ],
)
def test_bad_calls_name_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        call(**kwargs)


def test_the_wrapper_passes_zero_threads_on_as_an_error():
    # `num_threads or default` used to turn 0 into the default silently
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="num_threads"):
        cpu_adam.adam_step(z, z.clone(), z.clone(), z.clone(), step=1, lr=1e-3, num_threads=0)
    with pytest.raises(ValueError, match="num_threads"):
        cpu_adam.grad_stats(z, num_threads=0)
    with pytest.raises(ValueError, match="num_threads"):
        cpu_adam.adam_traffic(z, z.clone(), z.clone(), z.clone(), num_threads=0)


ABSURD_THREADS = """
import torch
from fxstar import _C
from fxstar.runtime import cpu_adam

n = 100_003
gen = torch.Generator().manual_seed(0)
grad = torch.randn(n, generator=gen)
results = {}
for threads in (1, 100_000, 2**31 - 1):
    state = [torch.ones(n), torch.zeros(n), torch.zeros(n)]
    for step in (1, 2):
        cpu_adam.adam_step(state[0], grad, state[1], state[2], step=step, lr=1e-3,
                           num_threads=threads)
    stats = cpu_adam.grad_stats(grad, num_threads=threads)
    scratch = [torch.ones(n), grad.clone(), torch.zeros(n), torch.zeros(n)]
    cpu_adam.adam_traffic(*scratch, num_threads=threads)
    results[threads] = (state, stats)
for threads in (100_000, 2**31 - 1):
    assert all(torch.equal(a, b) for a, b in zip(results[1][0], results[threads][0]))
    assert results[threads][1].finite
    assert abs(results[threads][1].sum_sq - results[1][1].sum_sq) < 1e-6 * results[1][1].sum_sq
assert _C.max_threads() >= 4
print("ok")
"""


def test_absurd_thread_counts_are_clamped_not_a_crash():
    # 100000 threads died by SIGSEGV and 2**31-1 aborted in libgomp: run where a crash is safe
    run = subprocess.run([sys.executable, "-c", ABSURD_THREADS], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_aliasing_is_refused():
    shared = torch.zeros(32)
    with pytest.raises(ValueError, match="param and exp_avg overlap"):
        call(param=shared[:16], exp_avg=shared[8:24])
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="grad and param overlap"):
        call(param=buf, grad=buf)
    with pytest.raises(ValueError, match="out and param overlap"):
        call(param=buf, out=buf.view(torch.bfloat16)[:16])
    grad = torch.zeros(32, dtype=torch.bfloat16)  # out may be grad, not a part of it
    with pytest.raises(ValueError, match="out and grad overlap"):
        call(param=torch.zeros(16), grad=grad[:16], out=grad[8:24])


def test_meta_tensors_are_refused_cleanly():
    with pytest.raises((TypeError, ValueError), match="param"):
        call(param=torch.empty(16, device="meta"))


def test_empty_buffers_are_a_no_op():
    empty = torch.zeros(0)
    call(param=empty, grad=torch.zeros(0), exp_avg=torch.zeros(0), exp_avg_sq=torch.zeros(0))
    assert cpu_adam.grad_stats(empty) == (0.0, True)
