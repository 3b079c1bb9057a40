// The avx2 build of the kernels; its instruction-set flags are set in CMakeLists.txt.
#include <algorithm>
#include <cmath>
#include <omp.h>
#include <type_traits>

#include "kernels.hpp"

#define FXSTAR_VARIANT_NAME "avx2"
namespace fxstar::avx2 {
#include "kernel_body.inl"
}  // namespace fxstar::avx2
