// Kernel bodies, included by each variant_*.cpp inside its own namespace and compiled with that
// variant's instruction-set flags. Plain loops under `omp parallel for simd`: the compiler
// vectorises them as well as hand-written intrinsics, for every variant from one source.
namespace {

// Each OpenMP thread's share of [0, n): one contiguous range, its bounds on a multiple of
// `align` elements (a whole cache line and vector), so no cache line is written by two threads
// and each thread's vector loop starts aligned with the arrays (no peeled scalar head).
struct Range {
  int64_t lo, hi;
};
inline Range thread_range(int64_t n, int64_t align) {
  const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
  const int64_t per = ((n + threads - 1) / threads + align - 1) / align * align;
  const int64_t lo = std::min(n, t * per);
  return {lo, std::min(n, lo + per)};
}

// The arithmetic follows torch.optim's single-tensor Adam operation by operation (lerp for the
// first moment as a fused multiply-add, as torch's kernel computes it; division by the bias
// correction; constants rounded from double), and the variants are built with
// -ffp-contract=off so nothing else is fused: results stay within an ulp or two of torch's
// (torch's own sqrt is not correctly rounded on every CPU, so bitwise equality is not possible).
// kAdamW and kLerpFromSelf are template arguments, not per-element selects: the loop then holds
// only the operations its hyperparameters need (AdamW adds no L2 term; one lerp formula).
template <typename G, typename O, bool kAdamW, bool kLerpFromSelf>
void adam_typed(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  using fxstar::store;
  using fxstar::to_float;
  const double beta1 = h.beta1, beta2 = h.beta2, lr = h.lr;
  const double bias1 = 1.0 - std::pow(beta1, static_cast<double>(h.step));
  const double bias2 = 1.0 - std::pow(beta2, static_cast<double>(h.step));
  const float neg_step_size = static_cast<float>(-lr / bias1);
  const float bias2_sqrt = static_cast<float>(std::sqrt(bias2));
  const float weight1 = static_cast<float>(1.0 - beta1);  // lerp weight of the new gradient
  const float b2 = static_cast<float>(beta2), one_minus_b2 = static_cast<float>(1.0 - beta2);
  const float eps = static_cast<float>(h.eps), scale = static_cast<float>(h.grad_scale);
  const float l2 = static_cast<float>(h.weight_decay);
  const float decay = static_cast<float>(1.0 - lr * h.weight_decay);
  float* __restrict p = b.param;
  // not __restrict: `out` may be `g` itself (the gradient in its parameters' room); each
  // block reads its gradients in the update loop before the copy loop writes over them
  const G* g = static_cast<const G*>(b.grad);
  float* __restrict m = b.exp_avg;
  float* __restrict v = b.exp_avg_sq;
  O* out = static_cast<O*>(b.out);
  const int64_t n = b.numel;

  // One element of the update, exactly as torch's single-tensor Adam(W) computes it. A macro,
  // not a lambda: captured pointers lose __restrict, and the loops then stay scalar.
#define FXSTAR_ADAM_UPDATE(i)                                                       \
  do {                                                                              \
    float pi = p[i];                                                                \
    float gi = to_float(g[i]) * scale;                                              \
    if constexpr (kAdamW) {                                                         \
      pi = pi * decay;                                                              \
    } else {                                                                        \
      gi = gi + l2 * pi;                                                            \
    }                                                                               \
    const float mi_old = m[i];                                                      \
    /* torch's lerp and addcmul kernels fuse their last multiply-add; so do these */ \
    const float mi = kLerpFromSelf ? std::fma(weight1, gi - mi_old, mi_old)         \
                                   : std::fma(weight1 - 1.0f, gi - mi_old, gi);     \
    const float vi = std::fma(one_minus_b2 * gi, gi, v[i] * b2);                    \
    const float denom = std::sqrt(vi) / bias2_sqrt + eps;                           \
    m[i] = mi;                                                                      \
    v[i] = vi;                                                                      \
    p[i] = pi + neg_step_size * mi / denom;                                         \
  } while (0)
  // 16 floats: one 64-byte cache line, one AVX-512 vector
  constexpr int64_t kAlign = 16;
  if constexpr (std::is_same_v<O, void>) {
#pragma omp parallel num_threads(threads)
    {
      const Range r = thread_range(n, kAlign);
#pragma omp simd
      for (int64_t i = r.lo; i < r.hi; ++i) FXSTAR_ADAM_UPDATE(i);
    }
  } else {
    // With a low-precision copy: blocks that stay in L1, the update loop and the copy loop
    // each vectorised on their own (one loop doing both runs scalar), the copy reading the
    // block from cache.
    constexpr int64_t kBlock = 2048;
#pragma omp parallel num_threads(threads)
    {
      const Range r = thread_range(n, kBlock);
      for (int64_t lo = r.lo; lo < r.hi; lo += kBlock) {
        const int64_t hi = std::min(r.hi, lo + kBlock);
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) FXSTAR_ADAM_UPDATE(i);
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) store(&out[i], p[i]);
      }
    }
  }
#undef FXSTAR_ADAM_UPDATE
}

// The hyperparameters that change the loop's operations, made template arguments once here.
template <typename G, typename O>
void adam_shaped(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  // torch's lerp picks its formula by the weight of the new value
  const bool lerp_from_self = static_cast<float>(1.0 - h.beta1) < 0.5f;
  if (h.adamw) {
    if (lerp_from_self) return adam_typed<G, O, true, true>(h, b, threads);
    return adam_typed<G, O, true, false>(h, b, threads);
  }
  if (lerp_from_self) return adam_typed<G, O, false, true>(h, b, threads);
  return adam_typed<G, O, false, false>(h, b, threads);
}

// The `void` output type means "no low-precision copy".
template <typename G>
void adam_out(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  if (b.out == nullptr) return adam_shaped<G, void>(h, b, threads);
  switch (b.out_dtype) {
    case fxstar::DType::bf16: return adam_shaped<G, fxstar::bf16>(h, b, threads);
    case fxstar::DType::f16: return adam_shaped<G, fxstar::f16>(h, b, threads);
    case fxstar::DType::f32: return adam_shaped<G, float>(h, b, threads);
  }
}

void adam(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  switch (b.grad_dtype) {
    case fxstar::DType::f32: return adam_out<float>(h, b, threads);
    case fxstar::DType::bf16: return adam_out<fxstar::bf16>(h, b, threads);
    case fxstar::DType::f16: return adam_out<fxstar::f16>(h, b, threads);
  }
}

// Sum of squares in double: a finite fp32/fp16/bf16 square can never overflow it, so the sum is
// finite exactly when every element is, and one read gives both the norm and the overflow flag.
template <typename G>
fxstar::GradStats grad_stats_typed(const G* __restrict g, int64_t n, int threads) {
  constexpr int kLanes = 32;  // independent accumulators hide the add latency
  double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    double acc[kLanes] = {};
    const int64_t blocks = n / kLanes;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const G* x = g + blk * kLanes;
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) {
        double d = fxstar::to_float(x[j]);
        acc[j] += d * d;
      }
    }
    double s = 0.0;
    for (int j = 0; j < kLanes; ++j) s += acc[j];
    total += s;
  }
  for (int64_t i = (n / kLanes) * kLanes; i < n; ++i) {
    double d = fxstar::to_float(g[i]);
    total += d * d;
  }
  return {total, std::isfinite(total)};
}

fxstar::GradStats grad_stats(const void* g, fxstar::DType dtype, int64_t n, int threads) {
  switch (dtype) {
    case fxstar::DType::f32: return grad_stats_typed(static_cast<const float*>(g), n, threads);
    case fxstar::DType::bf16:
      return grad_stats_typed(static_cast<const fxstar::bf16*>(g), n, threads);
    case fxstar::DType::f16:
      return grad_stats_typed(static_cast<const fxstar::f16*>(g), n, threads);
  }
  return {0.0, true};
}

void adam_traffic(float* __restrict p, const float* __restrict g, float* __restrict m,
                  float* __restrict v, int64_t n, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const Range r = thread_range(n, 16);
#pragma omp simd
    for (int64_t i = r.lo; i < r.hi; ++i) {
      const float gi = g[i];
      p[i] = 0.5f * p[i] + gi;
      m[i] = 0.5f * m[i] + gi;
      v[i] = 0.5f * v[i] + gi * gi;  // stays non-negative, like a second moment
    }
  }
}

}  // namespace

const fxstar::KernelTable table = {FXSTAR_VARIANT_NAME, adam, grad_stats, adam_traffic};
