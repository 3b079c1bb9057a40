// Kernel bodies, included by each variant_*.cpp inside its own namespace and compiled with that
// variant's instruction-set flags. Plain loops under `omp parallel for simd`: the compiler
// vectorises them as well as hand-written intrinsics, for every variant from one source.
namespace {

template <typename G, typename O>
void adam_typed(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  using fxstar::store;
  using fxstar::to_float;
  const double bias1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bias2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  const float step_size = static_cast<float>(h.lr / bias1);
  const float inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(bias2));
  const float b1 = h.beta1, b2 = h.beta2, one_minus_b1 = 1.0f - h.beta1,
              one_minus_b2 = 1.0f - h.beta2;
  const float eps = h.eps, scale = h.grad_scale;
  const float l2 = h.adamw ? 0.0f : h.weight_decay;
  const float decay = h.adamw ? static_cast<float>(1.0 - static_cast<double>(h.lr) * h.weight_decay)
                              : 1.0f;
  float* __restrict p = b.param;
  const G* __restrict g = static_cast<const G*>(b.grad);
  float* __restrict m = b.exp_avg;
  float* __restrict v = b.exp_avg_sq;
  O* __restrict out = static_cast<O*>(b.out);
  const int64_t n = b.numel;

#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i];
    float gi = to_float(g[i]) * scale + l2 * pi;
    float mi = b1 * m[i] + one_minus_b1 * gi;
    float vi = b2 * v[i] + one_minus_b2 * gi * gi;
    float denom = std::sqrt(vi) * inv_bias2_sqrt + eps;
    pi = pi * decay - step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if constexpr (!std::is_same_v<O, void>) store(&out[i], pi);
  }
}

// The `void` output type means "no low-precision copy".
template <typename G>
void adam_out(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  if (b.out == nullptr) return adam_typed<G, void>(h, b, threads);
  switch (b.out_dtype) {
    case fxstar::DType::bf16: return adam_typed<G, fxstar::bf16>(h, b, threads);
    case fxstar::DType::f16: return adam_typed<G, fxstar::f16>(h, b, threads);
    case fxstar::DType::f32: return adam_typed<G, float>(h, b, threads);
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
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] = 0.5f * p[i] + gi;
    m[i] = 0.5f * m[i] + gi;
    v[i] = 0.5f * v[i] + gi;
  }
}

}  // namespace

const fxstar::KernelTable table = {FXSTAR_VARIANT_NAME, adam, grad_stats, adam_traffic};
