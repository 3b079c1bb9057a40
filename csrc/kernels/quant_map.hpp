// 8-bit blockwise dynamic quantisation of optimizer moments, bitsandbytes' scheme (Dettmers et
// al., "8-bit Optimizers via Block-wise Quantization"): each block of kQuantBlock values keeps
// its largest magnitude (absmax, fp32) and one byte per value, the index of the nearest entry of
// a 256-entry "dynamic" map of [-1, 1] (signed, for exp_avg) or [0, 1] (unsigned, for
// exp_avg_sq). The map spends its entries per decade, 10^-6 .. 10^0, with more of them in the
// larger decades, so small values keep their relative precision the way a float's exponent does.
#pragma once
#include <cstdint>
#include <cstring>

namespace fxstar {

constexpr int64_t kQuantBlock = 256;  // values per absmax, as bitsandbytes' blockwise optimizers

// The nearest code is found from the float's bits: its magnitude, clamped to [2^-24, 1], falls
// in one of kBuckets buckets of 1/256 of a binade (the exponent and 8 mantissa bits), and no
// bucket holds two boundaries (the closest two, at the top of the unsigned map, are 0.7%
// apart; a bucket is at most 0.4% wide; dynamic_map checks it), so a bucket's first code and
// one comparison give the index a binary search over the boundaries would.
constexpr uint32_t kBucketLow = 0x33800000u;  // 2^-24: smaller magnitudes share the first bucket
constexpr uint32_t kBucketHigh = 0x3f800000u;  // 1.0: a scaled moment is never larger
constexpr int kBucketShift = 15;               // 23 mantissa bits less the 8 a bucket keeps
constexpr int kBuckets = static_cast<int>((kBucketHigh - kBucketLow) >> kBucketShift) + 1;

struct QuantMap {
  float code[256];  // ascending; holds 0 and 1
  float mid[256];   // mid[i] = (code[i] + code[i + 1]) / 2, the decision boundaries; mid[255] = inf
  // first[b] (b < kBuckets: positive values, then negative ones): the boundaries below every
  // value of bucket b (int32: the loop that quantises a block vectorises over them)
  int32_t first[2 * kBuckets];
};

const QuantMap& dynamic_map(bool is_signed);

// The bucket of x: its magnitude's, the negative ones after the positive ones.
inline int quant_bucket(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  uint32_t magnitude = bits & 0x7fffffffu;
  magnitude = magnitude < kBucketLow ? kBucketLow : magnitude;
  magnitude = magnitude > kBucketHigh ? kBucketHigh : magnitude;
  return static_cast<int>((magnitude - kBucketLow) >> kBucketShift) +
         static_cast<int>(bits >> 31) * kBuckets;
}

// The index of the nearest code: the number of boundaries below x (a tie goes to the lower
// code). For a signed map a nonzero x never lands on a code of the other sign or on 0 when it
// is negative (bitsandbytes keeps a moment's sign the same way), so a small negative first
// moment does not turn into an update of the wrong direction. x is finite, in [-1, 1].
inline uint8_t quantize_nearest(float x, const QuantMap& map, bool is_signed) {
  int lo = map.first[quant_bucket(x)];
  lo += static_cast<int>(map.mid[lo] < x);
  if (is_signed) {
    lo -= static_cast<int>(x < 0.0f) & static_cast<int>(map.code[lo] >= 0.0f);
    lo += static_cast<int>(x > 0.0f) & static_cast<int>(map.code[lo] < 0.0f);
  }
  return static_cast<uint8_t>(lo);
}

}  // namespace fxstar
