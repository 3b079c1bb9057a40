// The avx512 build of the kernels; its instruction-set flags are set in CMakeLists.txt.
#include <algorithm>
#include <cmath>
#include <omp.h>
#include <type_traits>

#include "kernels.hpp"

#define FXSTAR_VARIANT_NAME "avx512"
namespace fxstar::avx512 {
#include "kernel_body.inl"
}  // namespace fxstar::avx512
