#include "quant_map.hpp"

#include <algorithm>
#include <cmath>
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
  return map;
}

}  // namespace

const QuantMap& dynamic_map(bool is_signed) {
  static const QuantMap signed_map = build(true), unsigned_map = build(false);
  return is_signed ? signed_map : unsigned_map;
}

}  // namespace fxstar
