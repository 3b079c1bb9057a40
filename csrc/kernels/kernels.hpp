// The CPU kernels, compiled once per instruction-set variant (variant_*.cpp) and chosen at run
// time from the CPU's features: a single -march=native build would crash on an older CPU.
#pragma once
#include <cstdint>

#include "../dtype.hpp"
#include "quant_map.hpp"

namespace fxstar {

// Kept in double, as Python gives them: derived constants such as 1 - beta2 must be rounded to
// float once, from the double value, to agree with torch.
struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int64_t step;
  bool adamw;         // decoupled weight decay (AdamW) instead of L2 added to the gradient
  double grad_scale;  // gradients are multiplied by this first (1/loss_scale x clip factor)
};

struct AdamBuffers {
  float* param;
  const void* grad;
  DType grad_dtype;
  void* exp_avg;
  void* exp_avg_sq;
  DType moment_dtype;  // float32, or bfloat16 (computed in float32, stored rounded to nearest)
  void* out;           // optional low-precision copy of the updated parameter
  DType out_dtype;
  int64_t numel;
};

// Both moments 8-bit blockwise-quantised (quant_map.hpp): a code byte per element and an fp32
// absmax per kQuantBlock elements each.
struct Adam8bitBuffers {
  float* param;
  const void* grad;
  DType grad_dtype;
  uint8_t* exp_avg_codes;
  float* exp_avg_absmax;
  uint8_t* exp_avg_sq_codes;
  float* exp_avg_sq_absmax;
  void* out;
  DType out_dtype;
  int64_t numel;
};

struct GradStats {
  double sum_sq;
  bool finite;
};

struct KernelTable {
  const char* name;
  void (*adam)(const AdamHyper&, const AdamBuffers&, int threads);
  void (*adam_8bit)(const AdamHyper&, const Adam8bitBuffers&, int threads);
  GradStats (*grad_stats)(const void* grad, DType dtype, int64_t numel, int threads);
  // Adam's exact memory traffic (read p, g, m, v; write p, m, v) with trivial arithmetic: the
  // roofline the Adam kernel is measured against.
  void (*adam_traffic)(float* p, const float* g, float* m, float* v, int64_t numel, int threads);
};

#define FXSTAR_DECLARE_VARIANT(ns) \
  namespace ns {                   \
  extern const KernelTable table;  \
  }

FXSTAR_DECLARE_VARIANT(portable)
#if defined(__x86_64__) || defined(_M_X64)
#define FXSTAR_X86 1
FXSTAR_DECLARE_VARIANT(avx2)
FXSTAR_DECLARE_VARIANT(avx512)
#else
#define FXSTAR_X86 0
#endif

}  // namespace fxstar
