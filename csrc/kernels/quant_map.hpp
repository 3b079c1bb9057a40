// 8-bit blockwise dynamic quantisation of optimizer moments, bitsandbytes' scheme (Dettmers et
// al., "8-bit Optimizers via Block-wise Quantization"): each block of kQuantBlock values keeps
// its largest magnitude (absmax, fp32) and one byte per value, the index of the nearest entry of
// a 256-entry "dynamic" map of [-1, 1] (signed, for exp_avg) or [0, 1] (unsigned, for
// exp_avg_sq). The map spends its entries per decade, 10^-6 .. 10^0, with more of them in the
// larger decades, so small values keep their relative precision the way a float's exponent does.
#pragma once
#include <cstdint>

namespace fxstar {

constexpr int64_t kQuantBlock = 256;  // values per absmax, as bitsandbytes' blockwise optimizers

struct QuantMap {
  float code[256];  // ascending; holds 0 and 1
  float mid[255];   // mid[i] = (code[i] + code[i + 1]) / 2, the decision boundaries
};

const QuantMap& dynamic_map(bool is_signed);

// The index of the nearest code: the number of boundaries below x (a tie goes to the lower
// code). For a signed map a nonzero x never lands on a code of the other sign or on 0 when it
// is negative (bitsandbytes keeps a moment's sign the same way), so a small negative first
// moment does not turn into an update of the wrong direction.
inline uint8_t quantize_nearest(float x, const QuantMap& map, bool is_signed) {
  // a lower bound over the 255 boundaries in eight fixed steps, comparisons turned into
  // integers rather than branches (a branch here mispredicts half the time)
  int lo = static_cast<int>(map.mid[127] < x) << 7;
  lo += static_cast<int>(map.mid[lo + 63] < x) << 6;
  lo += static_cast<int>(map.mid[lo + 31] < x) << 5;
  lo += static_cast<int>(map.mid[lo + 15] < x) << 4;
  lo += static_cast<int>(map.mid[lo + 7] < x) << 3;
  lo += static_cast<int>(map.mid[lo + 3] < x) << 2;
  lo += static_cast<int>(map.mid[lo + 1] < x) << 1;
  lo += static_cast<int>(map.mid[lo] < x);
  if (is_signed) {
    lo -= static_cast<int>(x < 0.0f) & static_cast<int>(map.code[lo] >= 0.0f);
    lo += static_cast<int>(x > 0.0f) & static_cast<int>(map.code[lo] < 0.0f);
  }
  return static_cast<uint8_t>(lo);
}

}  // namespace fxstar
