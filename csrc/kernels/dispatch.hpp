// Chooses the kernel variant for this CPU once; a variant can also be asked for by name
// (tests, benchmarks, or FXSTAR_CPU_VARIANT=portable|avx2|avx512 in the environment).
#pragma once
#include <string>
#include <vector>

#include "kernels.hpp"

namespace fxstar {

// Variants this build contains that the running CPU can execute, best first.
std::vector<const KernelTable*> available_variants();
// The variant named, or the best available when `name` is empty; raises ValueError otherwise.
const KernelTable& select_variant(const std::string& name);
std::vector<std::string> cpu_features();

}  // namespace fxstar
