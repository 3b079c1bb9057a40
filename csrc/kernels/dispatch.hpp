// Chooses the kernel variant for this CPU once; a variant can also be asked for by name
// (tests, benchmarks, or FXSTAR_CPU_VARIANT=portable|avx2|avx512 in the environment).
#pragma once
#include <string>
#include <vector>

#include "kernels.hpp"

namespace fxstar {

// Variants this build contains that the running CPU can execute, best first.
std::vector<const KernelTable*> available_variants();
// The variant named, or when `name` is empty the one FXSTAR_CPU_VARIANT names, else the best
// available; a name that is not a variant this CPU runs is a ValueError listing those it does.
const KernelTable& select_variant(const std::string& name);
std::vector<std::string> cpu_features();

}  // namespace fxstar
