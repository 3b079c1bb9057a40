#include "adam_8bit.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "cpu_adam.hpp"
#include "kernels/dispatch.hpp"
#include "kernels/quant_map.hpp"
#include "tensor_arg.hpp"

namespace py = pybind11;

namespace fxstar {
namespace {

int64_t blocks_of(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

// A moment's two buffers: one uint8 code per element, one fp32 absmax per block.
struct QuantisedMoment {
  ByteBuffer codes;
  TensorArg absmax;
};

QuantisedMoment quantised_moment(py::handle codes, py::handle absmax, int64_t numel,
                                 const char* codes_name, const char* absmax_name) {
  QuantisedMoment q{byte_buffer_arg(codes, codes_name), tensor_arg(absmax, absmax_name)};
  if (q.codes.dtype != "uint8") {
    throw py::type_error(std::string(codes_name) + ": dtype " + q.codes.dtype +
                         " not allowed here (expected uint8)");
  }
  if (q.codes.nbytes != static_cast<uint64_t>(numel)) {
    throw py::value_error(std::string(codes_name) + ": has " + std::to_string(q.codes.nbytes) +
                          " elements but there are " + std::to_string(numel) +
                          " values; they must match");
  }
  require_dtype(q.absmax, {DType::f32});
  if (q.absmax.numel != blocks_of(numel)) {
    throw py::value_error(std::string(absmax_name) + ": has " + std::to_string(q.absmax.numel) +
                          " elements but " + std::to_string(numel) + " values make " +
                          std::to_string(blocks_of(numel)) + " blocks of " +
                          std::to_string(kQuantBlock) + "; they must match");
  }
  return q;
}

struct Span {
  const std::string* name;
  const char* data;
  uint64_t nbytes;
};
Span span(const TensorArg& t) { return {&t.name, static_cast<const char*>(t.data), t.nbytes()}; }
Span span(const ByteBuffer& b) { return {&b.name, b.data, b.nbytes}; }

// Raises ValueError naming the first two of `spans` whose bytes overlap.
void require_all_disjoint(std::initializer_list<Span> spans) {
  for (auto a = spans.begin(); a != spans.end(); ++a) {
    for (auto b = a + 1; b != spans.end(); ++b) {
      if (a->nbytes == 0 || b->nbytes == 0) continue;
      if (a->data < b->data + b->nbytes && b->data < a->data + a->nbytes) {
        throw py::value_error(*a->name + " and " + *b->name +
                              " overlap in memory; they must be separate buffers");
      }
    }
  }
}

}  // namespace

void adam_step_8bit(py::handle param, py::handle grad, py::handle exp_avg_codes,
                    py::handle exp_avg_absmax, py::handle exp_avg_sq_codes,
                    py::handle exp_avg_sq_absmax, double lr, double beta1, double beta2,
                    double eps, double weight_decay, int64_t step, bool adamw, double grad_scale,
                    py::handle out, int64_t num_threads, const std::string& variant) {
  const AdamHyper h = checked_hyper(lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale);
  const int threads = checked_threads(num_threads);
  const KernelTable& kernels = select_variant(variant);
  TensorArg p = tensor_arg(param, "param");
  require_dtype(p, {DType::f32});
  const QuantisedMoment m =
      quantised_moment(exp_avg_codes, exp_avg_absmax, p.numel, "exp_avg_codes", "exp_avg_absmax");
  const QuantisedMoment v = quantised_moment(exp_avg_sq_codes, exp_avg_sq_absmax, p.numel,
                                             "exp_avg_sq_codes", "exp_avg_sq_absmax");
  TensorArg g = tensor_arg(grad, "grad");
  require_same_numel(p, g);
  require_all_disjoint({span(p), span(g), span(m.codes), span(m.absmax), span(v.codes),
                        span(v.absmax)});
  const CopyOut o = checked_out(out, p, g, {&p, &m.absmax, &v.absmax});
  if (o.data != nullptr) require_all_disjoint({span(o.arg), span(m.codes), span(v.codes)});
  const Adam8bitBuffers b{static_cast<float*>(p.data),
                          g.data,
                          g.dtype,
                          reinterpret_cast<uint8_t*>(m.codes.data),
                          static_cast<float*>(m.absmax.data),
                          reinterpret_cast<uint8_t*>(v.codes.data),
                          static_cast<float*>(v.absmax.data),
                          o.data,
                          o.dtype,
                          p.numel};
  if (b.numel == 0) return;
  py::gil_scoped_release no_gil;
  kernels.adam_8bit(h, b, threads);
}

void quantize_moment(py::handle values, py::handle codes, py::handle absmax, bool is_signed) {
  TensorArg x = tensor_arg(values, "values");
  require_dtype(x, {DType::f32});
  const QuantisedMoment q = quantised_moment(codes, absmax, x.numel, "codes", "absmax");
  require_all_disjoint({span(x), span(q.codes), span(q.absmax)});
  const float* in = static_cast<const float*>(x.data);
  if (!is_signed) {
    for (int64_t i = 0; i < x.numel; ++i) {
      if (!(in[i] >= 0.0f)) {
        throw py::value_error("values: a second moment is never negative, got " +
                              std::to_string(in[i]) + " at " + std::to_string(i));
      }
    }
  }
  py::gil_scoped_release no_gil;
  const QuantMap& map = dynamic_map(is_signed);
  auto* out = reinterpret_cast<uint8_t*>(q.codes.data);
  auto* scales = static_cast<float*>(q.absmax.data);
  for (int64_t lo = 0, block = 0; lo < x.numel; lo += kQuantBlock, ++block) {
    const int64_t hi = std::min(x.numel, lo + kQuantBlock);
    float largest = 0.0f;
    for (int64_t i = lo; i < hi; ++i) largest = std::max(largest, std::fabs(in[i]));
    scales[block] = largest;
    const float divisor = largest > 0.0f ? largest : 1.0f;
    for (int64_t i = lo; i < hi; ++i) out[i] = quantize_nearest(in[i] / divisor, map, is_signed);
  }
}

void dequantize_moment(py::handle codes, py::handle absmax, py::handle out, bool is_signed) {
  TensorArg y = tensor_arg(out, "out");
  require_dtype(y, {DType::f32});
  const QuantisedMoment q = quantised_moment(codes, absmax, y.numel, "codes", "absmax");
  require_all_disjoint({span(y), span(q.codes), span(q.absmax)});
  py::gil_scoped_release no_gil;
  const QuantMap& map = dynamic_map(is_signed);
  const auto* in = reinterpret_cast<const uint8_t*>(q.codes.data);
  const auto* scales = static_cast<const float*>(q.absmax.data);
  auto* values = static_cast<float*>(y.data);
  for (int64_t i = 0; i < y.numel; ++i) values[i] = map.code[in[i]] * scales[i / kQuantBlock];
}

std::vector<float> quantization_map(bool is_signed) {
  const QuantMap& map = dynamic_map(is_signed);
  return {map.code, map.code + 256};
}

}  // namespace fxstar
