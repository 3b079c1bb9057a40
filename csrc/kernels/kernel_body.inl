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
// Every state layout (fp32, bf16 or 8-bit moments) runs this one update; only how a moment is
// loaded and stored differs.
#define FXSTAR_ADAM_CONSTANTS(h)                                                        \
  const double beta1 = (h).beta1, beta2 = (h).beta2, lr = (h).lr;                       \
  const double bias1 = 1.0 - std::pow(beta1, static_cast<double>((h).step));            \
  const double bias2 = 1.0 - std::pow(beta2, static_cast<double>((h).step));            \
  const float neg_step_size = static_cast<float>(-lr / bias1);                          \
  const float bias2_sqrt = static_cast<float>(std::sqrt(bias2));                        \
  const float weight1 = static_cast<float>(1.0 - beta1); /* lerp weight of the new g */ \
  const float b2 = static_cast<float>(beta2), one_minus_b2 = static_cast<float>(1.0 - beta2); \
  const float eps = static_cast<float>((h).eps), scale = static_cast<float>((h).grad_scale); \
  const float l2 = static_cast<float>((h).weight_decay);                                \
  const float decay = static_cast<float>(1.0 - lr * (h).weight_decay)

// One element of the update, exactly as torch's single-tensor Adam(W) computes it: P the fp32
// parameter, G the gradient, M and V the moments (float32 or bfloat16 lvalues). A macro, not a
// lambda: captured pointers lose __restrict, and the loops then stay scalar.
#define FXSTAR_ADAM_ELEMENT(P, G, M, V)                                             \
  do {                                                                              \
    float pi = (P);                                                                 \
    float gi = to_float(G) * scale;                                                 \
    if constexpr (kAdamW) {                                                         \
      pi = pi * decay;                                                              \
    } else {                                                                        \
      gi = gi + l2 * pi;                                                            \
    }                                                                               \
    const float mi_old = to_float(M);                                               \
    /* torch's lerp and addcmul kernels fuse their last multiply-add; so do these */ \
    const float mi = kLerpFromSelf ? std::fma(weight1, gi - mi_old, mi_old)         \
                                   : std::fma(weight1 - 1.0f, gi - mi_old, gi);     \
    const float vi = std::fma(one_minus_b2 * gi, gi, to_float(V) * b2);             \
    const float denom = std::sqrt(vi) / bias2_sqrt + eps;                           \
    store(&(M), mi);                                                                \
    store(&(V), vi);                                                                \
    (P) = pi + neg_step_size * mi / denom;                                          \
  } while (0)

template <typename G, typename O, typename M, bool kAdamW, bool kLerpFromSelf>
void adam_typed(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  using fxstar::store;
  using fxstar::to_float;
  FXSTAR_ADAM_CONSTANTS(h);
  float* __restrict p = b.param;
  // not __restrict: `out` may be `g` itself (the gradient in its parameters' room); each
  // block reads its gradients in the update loop before the copy loop writes over them
  const G* g = static_cast<const G*>(b.grad);
  M* __restrict m = static_cast<M*>(b.exp_avg);
  M* __restrict v = static_cast<M*>(b.exp_avg_sq);
  O* out = static_cast<O*>(b.out);
  const int64_t n = b.numel;

  // 16 floats: one 64-byte cache line, one AVX-512 vector
  constexpr int64_t kAlign = 16;
  if constexpr (std::is_same_v<O, void>) {
#pragma omp parallel num_threads(threads)
    {
      const Range r = thread_range(n, kAlign);
#pragma omp simd
      for (int64_t i = r.lo; i < r.hi; ++i) FXSTAR_ADAM_ELEMENT(p[i], g[i], m[i], v[i]);
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
        for (int64_t i = lo; i < hi; ++i) FXSTAR_ADAM_ELEMENT(p[i], g[i], m[i], v[i]);
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) store(&out[i], p[i]);
      }
    }
  }
}

// 8-bit moments, a quantisation block at a time (each block is one thread's): dequantise with
// the block's absmax, the update above in fp32, the block's new absmax, requantise to the
// nearest code. bitsandbytes' blockwise 8-bit Adam does the same per block.
template <typename G, typename O, bool kAdamW, bool kLerpFromSelf>
void adam_8bit_typed(const fxstar::AdamHyper& h, const fxstar::Adam8bitBuffers& b,
                     int threads) {
  using fxstar::kQuantBlock;
  using fxstar::store;
  using fxstar::to_float;
  FXSTAR_ADAM_CONSTANTS(h);
  const fxstar::QuantMap& m_map = fxstar::dynamic_map(true);
  const fxstar::QuantMap& v_map = fxstar::dynamic_map(false);
  float* __restrict p = b.param;
  const G* g = static_cast<const G*>(b.grad);  // may be `out`, as in adam_typed
  O* out = static_cast<O*>(b.out);
  const int64_t n = b.numel;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float mb[kQuantBlock];
    alignas(64) float vb[kQuantBlock];
    const Range r = thread_range(n, kQuantBlock);
    for (int64_t lo = r.lo; lo < r.hi; lo += kQuantBlock) {
      const int64_t len = std::min(r.hi - lo, kQuantBlock), block = lo / kQuantBlock;
      uint8_t* __restrict mc = b.exp_avg_codes + lo;
      uint8_t* __restrict vc = b.exp_avg_sq_codes + lo;
      const float m_absmax = b.exp_avg_absmax[block], v_absmax = b.exp_avg_sq_absmax[block];
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        mb[j] = m_map.code[mc[j]] * m_absmax;
        vb[j] = v_map.code[vc[j]] * v_absmax;
      }
      float m_max = 0.0f, v_max = 0.0f;
#pragma omp simd reduction(max : m_max, v_max)
      for (int64_t j = 0; j < len; ++j) {
        FXSTAR_ADAM_ELEMENT(p[lo + j], g[lo + j], mb[j], vb[j]);
        m_max = std::max(m_max, std::fabs(mb[j]));
        v_max = std::max(v_max, vb[j]);
      }
      b.exp_avg_absmax[block] = m_max;
      b.exp_avg_sq_absmax[block] = v_max;
      // a block of zeros (absmax 0) is stored as code 0 x 0: any code reads back as 0
      const float m_div = m_max > 0.0f ? m_max : 1.0f, v_div = v_max > 0.0f ? v_max : 1.0f;
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        mc[j] = fxstar::quantize_nearest(mb[j] / m_div, m_map, true);
        vc[j] = fxstar::quantize_nearest(vb[j] / v_div, v_map, false);
      }
      if constexpr (!std::is_same_v<O, void>) {
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) store(&out[lo + j], p[lo + j]);
      }
    }
  }
}
#undef FXSTAR_ADAM_ELEMENT
#undef FXSTAR_ADAM_CONSTANTS

// The hyperparameters that change the loop's operations, made template arguments once here.
// `Kernel` is a template of <bool kAdamW, bool kLerpFromSelf> instantiated by the caller.
template <template <bool, bool> class Kernel, typename Buffers>
void adam_shaped(const fxstar::AdamHyper& h, const Buffers& b, int threads) {
  // torch's lerp picks its formula by the weight of the new value
  const bool lerp_from_self = static_cast<float>(1.0 - h.beta1) < 0.5f;
  if (h.adamw) {
    if (lerp_from_self) return Kernel<true, true>::run(h, b, threads);
    return Kernel<true, false>::run(h, b, threads);
  }
  if (lerp_from_self) return Kernel<false, true>::run(h, b, threads);
  return Kernel<false, false>::run(h, b, threads);
}

template <typename G, typename O, typename M>
struct AdamKernel {
  template <bool kAdamW, bool kLerpFromSelf>
  struct With {
    static void run(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
      adam_typed<G, O, M, kAdamW, kLerpFromSelf>(h, b, threads);
    }
  };
};

template <typename G, typename O>
struct Adam8bitKernel {
  template <bool kAdamW, bool kLerpFromSelf>
  struct With {
    static void run(const fxstar::AdamHyper& h, const fxstar::Adam8bitBuffers& b, int threads) {
      adam_8bit_typed<G, O, kAdamW, kLerpFromSelf>(h, b, threads);
    }
  };
};

template <typename G, typename O>
void adam_moments(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  if (b.moment_dtype == fxstar::DType::bf16) {
    return adam_shaped<AdamKernel<G, O, fxstar::bf16>::template With>(h, b, threads);
  }
  return adam_shaped<AdamKernel<G, O, float>::template With>(h, b, threads);
}

template <typename G, typename O>
void adam_moments(const fxstar::AdamHyper& h, const fxstar::Adam8bitBuffers& b, int threads) {
  return adam_shaped<Adam8bitKernel<G, O>::template With>(h, b, threads);
}

// The `void` output type means "no low-precision copy".
template <typename G, typename Buffers>
void adam_out(const fxstar::AdamHyper& h, const Buffers& b, int threads) {
  if (b.out == nullptr) return adam_moments<G, void>(h, b, threads);
  switch (b.out_dtype) {
    case fxstar::DType::bf16: return adam_moments<G, fxstar::bf16>(h, b, threads);
    case fxstar::DType::f16: return adam_moments<G, fxstar::f16>(h, b, threads);
    case fxstar::DType::f32: return adam_moments<G, float>(h, b, threads);
  }
}

template <typename Buffers>
void adam_any(const fxstar::AdamHyper& h, const Buffers& b, int threads) {
  switch (b.grad_dtype) {
    case fxstar::DType::f32: return adam_out<float>(h, b, threads);
    case fxstar::DType::bf16: return adam_out<fxstar::bf16>(h, b, threads);
    case fxstar::DType::f16: return adam_out<fxstar::f16>(h, b, threads);
  }
}

void adam(const fxstar::AdamHyper& h, const fxstar::AdamBuffers& b, int threads) {
  adam_any(h, b, threads);
}

void adam_8bit(const fxstar::AdamHyper& h, const fxstar::Adam8bitBuffers& b, int threads) {
  adam_any(h, b, threads);
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

const fxstar::KernelTable table = {FXSTAR_VARIANT_NAME, adam, adam_8bit, grad_stats,
                                   adam_traffic};
