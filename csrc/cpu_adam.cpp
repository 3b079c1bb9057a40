#include "cpu_adam.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <sstream>
#include <string>
#include <thread>

#include "kernels/dispatch.hpp"
#include "tensor_arg.hpp"

namespace py = pybind11;

namespace fxstar {
namespace {

void require(bool ok, const std::string& msg) {
  if (!ok) throw py::value_error(msg);
}

// The kernels compute in float32: a hyperparameter that is finite as a double but not as a
// float (lr=1e300) would still make every parameter inf or NaN.
bool finite_f32(double x) { return std::isfinite(x) && std::isfinite(static_cast<float>(x)); }

std::string str(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

// Parameter (fp32) and both moments (fp32, or both bf16): the same size, pairwise disjoint.
struct AdamState {
  TensorArg param, exp_avg, exp_avg_sq;
};

AdamState adam_state(py::handle param, py::handle exp_avg, py::handle exp_avg_sq) {
  AdamState s{tensor_arg(param, "param"), tensor_arg(exp_avg, "exp_avg"),
              tensor_arg(exp_avg_sq, "exp_avg_sq")};
  require_dtype(s.param, {DType::f32});
  require_dtype(s.exp_avg, {DType::f32, DType::bf16});
  require_dtype(s.exp_avg_sq, {DType::f32, DType::bf16});
  if (s.exp_avg.dtype != s.exp_avg_sq.dtype) {
    throw py::type_error(std::string("exp_avg: dtype ") + dtype_name(s.exp_avg.dtype) +
                         " with exp_avg_sq " + dtype_name(s.exp_avg_sq.dtype) +
                         ": both moments must be float32 or both bfloat16");
  }
  require_same_numel(s.param, s.exp_avg);
  require_same_numel(s.param, s.exp_avg_sq);
  require_disjoint(s.param, s.exp_avg);
  require_disjoint(s.param, s.exp_avg_sq);
  require_disjoint(s.exp_avg, s.exp_avg_sq);
  return s;
}

void require_disjoint_from_state(const TensorArg& t, const AdamState& s) {
  for (const TensorArg* other : {&s.param, &s.exp_avg, &s.exp_avg_sq}) require_disjoint(t, *other);
}

}  // namespace

int checked_threads(int64_t num_threads) {
  require(num_threads >= 1, "num_threads: must be at least 1, got " + std::to_string(num_threads));
  return static_cast<int>(std::min<int64_t>(num_threads, max_threads()));
}

int max_threads() {
  const unsigned cores = std::thread::hardware_concurrency();
  return static_cast<int>(std::max(1u, cores)) * kThreadsPerCore;
}

AdamHyper checked_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                        int64_t step, bool adamw, double grad_scale) {
  require(finite_f32(lr) && lr >= 0, "lr: must be a finite float32 >= 0, got " + str(lr));
  require(beta1 >= 0 && beta1 < 1, "beta1: must be in [0, 1), got " + str(beta1));
  require(beta2 >= 0 && beta2 < 1, "beta2: must be in [0, 1), got " + str(beta2));
  // eps keeps the denominator away from 0 where a gradient and its moments are 0: at 0, or
  // below float32's smallest normal (flushed to 0 under FTZ), the update is 0/0 = NaN.
  require(finite_f32(eps) && eps >= FLT_MIN,
          "eps: must be a finite float32 >= " + str(FLT_MIN) + ", got " + str(eps));
  require(finite_f32(weight_decay) && weight_decay >= 0,
          "weight_decay: must be a finite float32 >= 0, got " + str(weight_decay));
  require(step >= 1, "step: counts from 1, got " + std::to_string(step));
  require(finite_f32(grad_scale), "grad_scale: must be a finite float32, got " + str(grad_scale));
  return AdamHyper{lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale};
}

CopyOut checked_out(py::handle out, const TensorArg& param, const TensorArg& grad,
                    std::initializer_list<const TensorArg*> state) {
  CopyOut c;
  if (out.is_none()) return c;
  c.arg = tensor_arg(out, "out");
  require_dtype(c.arg, {DType::bf16, DType::f16});
  require_same_numel(param, c.arg);
  for (const TensorArg* t : state) require_disjoint(c.arg, *t);
  // out may be the gradient itself (the bf16/fp16 gradient in its parameters' room, as
  // PatrickStar keeps it): each element's gradient is read before its copy is written
  const bool in_place = c.arg.data == grad.data && c.arg.dtype == grad.dtype;
  if (!in_place) require_disjoint(c.arg, grad);
  c.data = c.arg.data;
  c.dtype = c.arg.dtype;
  return c;
}

void adam_step(py::handle param, py::handle grad, py::handle exp_avg, py::handle exp_avg_sq,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               int64_t step, bool adamw, double grad_scale, py::handle out, int64_t num_threads,
               const std::string& variant) {
  const AdamHyper h = checked_hyper(lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale);
  const int threads = checked_threads(num_threads);
  const KernelTable& kernels = select_variant(variant);

  AdamState s = adam_state(param, exp_avg, exp_avg_sq);
  TensorArg g = tensor_arg(grad, "grad");
  require_same_numel(s.param, g);
  require_disjoint_from_state(g, s);
  const CopyOut o = checked_out(out, s.param, g, {&s.param, &s.exp_avg, &s.exp_avg_sq});
  const AdamBuffers b{static_cast<float*>(s.param.data),
                      g.data,
                      g.dtype,
                      s.exp_avg.data,
                      s.exp_avg_sq.data,
                      s.exp_avg.dtype,
                      o.data,
                      o.dtype,
                      s.param.numel};
  if (b.numel == 0) return;
  py::gil_scoped_release no_gil;
  kernels.adam(h, b, threads);
}

std::pair<double, bool> grad_stats(py::handle grad, int64_t num_threads,
                                   const std::string& variant) {
  const int threads = checked_threads(num_threads);
  const KernelTable& kernels = select_variant(variant);
  TensorArg g = tensor_arg(grad, "grad");
  GradStats r;
  {
    py::gil_scoped_release no_gil;
    r = kernels.grad_stats(g.data, g.dtype, g.numel, threads);
  }
  return {r.sum_sq, r.finite};
}

void adam_traffic(py::handle param, py::handle grad, py::handle exp_avg, py::handle exp_avg_sq,
                  int64_t num_threads, const std::string& variant) {
  const int threads = checked_threads(num_threads);
  const KernelTable& kernels = select_variant(variant);
  AdamState s = adam_state(param, exp_avg, exp_avg_sq);
  require_dtype(s.exp_avg, {DType::f32});
  TensorArg g = tensor_arg(grad, "grad");
  require_dtype(g, {DType::f32});
  require_same_numel(s.param, g);
  require_disjoint_from_state(g, s);
  py::gil_scoped_release no_gil;
  kernels.adam_traffic(static_cast<float*>(s.param.data), static_cast<const float*>(g.data),
                       static_cast<float*>(s.exp_avg.data), static_cast<float*>(s.exp_avg_sq.data),
                       s.param.numel, threads);
}

}  // namespace fxstar
