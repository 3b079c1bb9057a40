#include "dispatch.hpp"

#include <pybind11/pybind11.h>

#include <cstdlib>

namespace fxstar {
namespace {

#if FXSTAR_X86
bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
}
#endif

const KernelTable* default_variant() {
  static const KernelTable* chosen = [] {
    auto variants = available_variants();
    if (const char* forced = std::getenv("FXSTAR_CPU_VARIANT"); forced && *forced) {
      for (auto* v : variants)
        if (std::string(v->name) == forced) return v;
    }
    return variants.front();
  }();
  return chosen;
}

}  // namespace

std::vector<const KernelTable*> available_variants() {
  std::vector<const KernelTable*> out;
#if FXSTAR_X86
  if (has_avx512()) out.push_back(&avx512::table);
  if (has_avx2()) out.push_back(&avx2::table);
#endif
  out.push_back(&portable::table);
  return out;
}

const KernelTable& select_variant(const std::string& name) {
  if (name.empty()) return *default_variant();
  std::string known;
  for (auto* v : available_variants()) {
    if (name == v->name) return *v;
    known += std::string(known.empty() ? "" : ", ") + v->name;
  }
  throw pybind11::value_error("variant: '" + name + "' is not available on this CPU (available: " +
                              known + ")");
}

std::vector<std::string> cpu_features() {
  std::vector<std::string> out;
#if FXSTAR_X86
  __builtin_cpu_init();
#define FXSTAR_FEATURE(name) \
  if (__builtin_cpu_supports(name)) out.emplace_back(name);
  FXSTAR_FEATURE("sse4.2")
  FXSTAR_FEATURE("avx")
  FXSTAR_FEATURE("avx2")
  FXSTAR_FEATURE("fma")
  FXSTAR_FEATURE("f16c")
  FXSTAR_FEATURE("bmi2")
  FXSTAR_FEATURE("avx512f")
  FXSTAR_FEATURE("avx512bw")
  FXSTAR_FEATURE("avx512vl")
  FXSTAR_FEATURE("avx512dq")
  FXSTAR_FEATURE("avx512bf16")
#undef FXSTAR_FEATURE
#endif
  return out;
}

}  // namespace fxstar
