// The portable build of the kernels; its instruction-set flags are set in CMakeLists.txt.
#include <algorithm>
#include <cmath>
#include <omp.h>
#include <type_traits>

#include "kernels.hpp"

#define FXSTAR_VARIANT_NAME "portable"
namespace fxstar::portable {
#include "kernel_body.inl"
}  // namespace fxstar::portable
