// Element types the kernels read and write, and their scalar conversions. bf16 is handled by
// bit manipulation (exactly torch's round-to-nearest-even), fp16 through the compiler's _Float16.
#pragma once
#include <cstdint>
#include <cstring>

namespace fxstar {

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
  }
  return "?";
}

inline size_t itemsize(DType d) { return d == DType::f32 ? 4 : 2; }

struct bf16 {
  uint16_t bits;
};

#if defined(__FLT16_MAX__)
using f16 = _Float16;
#define FXSTAR_HAVE_FLOAT16 1
#else
struct f16 {
  uint16_t bits;
};
#define FXSTAR_HAVE_FLOAT16 0
#endif

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store(float* out, float f) { *out = f; }

inline void store(bf16* out, float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  // a select, not a branch, so loops that store bf16 still vectorise; NaN becomes torch's
  // canonical quiet NaN
  const uint32_t bits = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded;
  out->bits = static_cast<uint16_t>(bits);
}

#if FXSTAR_HAVE_FLOAT16
inline float to_float(f16 x) { return static_cast<float>(x); }
inline void store(f16* out, float f) { *out = static_cast<f16>(f); }
#else
#error "fxstar needs a compiler with _Float16 (GCC >= 12 or Clang >= 15)"
#endif

}  // namespace fxstar
