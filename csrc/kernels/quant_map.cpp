#include "quant_map.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

namespace fxstar {
namespace {

// Decade d (0..6) covers 10^(d-6) x [0.1, 1] with 2^d values a side (signed) or 2^(d+1)
// (unsigned): the midpoints of that many equal steps of [0.1, 1]. With 0 and 1 that is 256
// (signed: 127 a side; the most negative code is a little above -1, as in bitsandbytes).
QuantMap build(bool is_signed) {
  std::vector<double> values{0.0, 1.0};
  for (int d = 0; d < 7; ++d) {
    const int count = is_signed ? (1 << d) : (1 << (d + 1));
    const double scale = std::pow(10.0, d - 6);
    for (int j = 0; j < count; ++j) {
      const double lo = 0.1 + 0.9 * j / count, hi = 0.1 + 0.9 * (j + 1) / count;
      values.push_back(scale * (lo + hi) / 2);
      if (is_signed) values.push_back(-scale * (lo + hi) / 2);
    }
  }
  std::sort(values.begin(), values.end());
  QuantMap map{};
  for (int i = 0; i < 256; ++i) map.code[i] = static_cast<float>(values[static_cast<size_t>(i)]);
  for (int i = 0; i < 255; ++i) map.mid[i] = (map.code[i] + map.code[i + 1]) * 0.5f;
  map.mid[255] = std::numeric_limits<float>::infinity();
  // each bucket's values run from `least` to `most`: its first code counts the boundaries
  // below `least`, and no other boundary may lie below `most`
  auto below = [&map](float x) {
    return static_cast<int>(std::lower_bound(map.mid, map.mid + 255, x) - map.mid);
  };
  auto value = [](uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  };
  for (int b = 0; b < kBuckets; ++b) {
    const uint32_t low = b == 0 ? 0u : kBucketLow + (static_cast<uint32_t>(b) << kBucketShift);
    const uint32_t high =
        b == kBuckets - 1 ? kBucketHigh : kBucketLow + ((b + 1u) << kBucketShift) - 1u;
    for (int negative = 0; negative < 2; ++negative) {
      const uint32_t sign = negative ? 0x80000000u : 0u;
      const float least = value(sign | (negative ? high : low));
      const float most = value(sign | (negative ? low : high));
      const int first = below(least);
      // the comparison with mid[first] adds the one boundary a bucket may hold
      if (below(most) > first + 1) {
        throw std::logic_error("quant_map: a bucket holds two decision boundaries");
      }
      map.first[b + negative * kBuckets] = first;
    }
  }
  return map;
}

}  // namespace

const QuantMap& dynamic_map(bool is_signed) {
  static const QuantMap signed_map = build(true), unsigned_map = build(false);
  return is_signed ? signed_map : unsigned_map;
}

}  // namespace fxstar
