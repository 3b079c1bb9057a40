#include "dispatch.hpp"

#include <pybind11/pybind11.h>

#include <cstdlib>
#include <string>

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

// Every variant this build contains, best first, whether or not this CPU can run it.
std::vector<const KernelTable*> built_variants() {
#if FXSTAR_X86
  return {&avx512::table, &avx2::table, &portable::table};
#else
  return {&portable::table};
#endif
}

std::string joined(const std::vector<const KernelTable*>& variants) {
  std::string out;
  for (auto* v : variants) out += std::string(out.empty() ? "" : ", ") + v->name;
  return out;
}

// The variant called `name`; otherwise a ValueError that names `source` (the argument or the
// environment variable), says why, and lists the variants to choose from.
const KernelTable& find_variant(const std::string& name, const std::string& source,
                                const std::string& hint) {
  auto available = available_variants();
  for (auto* v : available)
    if (name == v->name) return *v;
  bool built = false;
  for (auto* v : built_variants()) built = built || name == v->name;
  std::string why = built ? "is not available on this CPU" : "is not a kernel variant";
  throw pybind11::value_error(source + ": '" + name + "' " + why + "; valid on this CPU: " +
                              joined(available) + hint);
}

// The best variant, or the one FXSTAR_CPU_VARIANT names: a name that is not a variant, or not
// one this CPU runs, is an error at the first kernel call (and each after), not a silent
// fallback to the best.
const KernelTable* default_variant() {
  static const KernelTable* chosen = [] {
    if (const char* forced = std::getenv("FXSTAR_CPU_VARIANT"); forced && *forced)
      return &find_variant(forced, "FXSTAR_CPU_VARIANT",
                           " (unset it to choose the best automatically)");
    return available_variants().front();
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
  return find_variant(name, "variant", "");
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
