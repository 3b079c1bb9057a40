#include "cpu_adam.hpp"

#include <cmath>
#include <sstream>
#include <string>

#include "kernels/dispatch.hpp"
#include "tensor_arg.hpp"

namespace py = pybind11;

namespace fxstar {
namespace {

void require(bool ok, const std::string& msg) {
  if (!ok) throw py::value_error(msg);
}

void check_threads(int num_threads) {
  require(num_threads >= 1, "num_threads: must be at least 1, got " + std::to_string(num_threads));
}

std::string str(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

// Parameter and both moments: fp32, the same size, pairwise disjoint.
struct AdamState {
  TensorArg param, exp_avg, exp_avg_sq;
};

AdamState adam_state(py::handle param, py::handle exp_avg, py::handle exp_avg_sq) {
  AdamState s{tensor_arg(param, "param"), tensor_arg(exp_avg, "exp_avg"),
              tensor_arg(exp_avg_sq, "exp_avg_sq")};
  for (const TensorArg* t : {&s.param, &s.exp_avg, &s.exp_avg_sq}) require_dtype(*t, {DType::f32});
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

void adam_step(py::handle param, py::handle grad, py::handle exp_avg, py::handle exp_avg_sq,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               int64_t step, bool adamw, double grad_scale, py::handle out, int num_threads,
               const std::string& variant) {
  require(std::isfinite(lr) && lr >= 0, "lr: must be finite and >= 0, got " + str(lr));
  require(beta1 >= 0 && beta1 < 1, "beta1: must be in [0, 1), got " + str(beta1));
  require(beta2 >= 0 && beta2 < 1, "beta2: must be in [0, 1), got " + str(beta2));
  require(std::isfinite(eps) && eps >= 0, "eps: must be finite and >= 0, got " + str(eps));
  require(std::isfinite(weight_decay) && weight_decay >= 0,
          "weight_decay: must be finite and >= 0, got " + str(weight_decay));
  require(step >= 1, "step: counts from 1, got " + std::to_string(step));
  require(std::isfinite(grad_scale), "grad_scale: must be finite, got " + str(grad_scale));
  check_threads(num_threads);
  const KernelTable& kernels = select_variant(variant);

  AdamState s = adam_state(param, exp_avg, exp_avg_sq);
  TensorArg g = tensor_arg(grad, "grad");
  require_same_numel(s.param, g);
  require_disjoint_from_state(g, s);
  AdamBuffers b{static_cast<float*>(s.param.data),
                g.data,
                g.dtype,
                static_cast<float*>(s.exp_avg.data),
                static_cast<float*>(s.exp_avg_sq.data),
                nullptr,
                DType::bf16,
                s.param.numel};
  TensorArg o;
  if (!out.is_none()) {
    o = tensor_arg(out, "out");
    require_dtype(o, {DType::bf16, DType::f16});
    require_same_numel(s.param, o);
    require_disjoint_from_state(o, s);
    require_disjoint(o, g);
    b.out = o.data;
    b.out_dtype = o.dtype;
  }
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale};
  if (b.numel == 0) return;
  py::gil_scoped_release no_gil;
  kernels.adam(h, b, num_threads);
}

std::pair<double, bool> grad_stats(py::handle grad, int num_threads, const std::string& variant) {
  check_threads(num_threads);
  const KernelTable& kernels = select_variant(variant);
  TensorArg g = tensor_arg(grad, "grad");
  GradStats r;
  {
    py::gil_scoped_release no_gil;
    r = kernels.grad_stats(g.data, g.dtype, g.numel, num_threads);
  }
  return {r.sum_sq, r.finite};
}

void adam_traffic(py::handle param, py::handle grad, py::handle exp_avg, py::handle exp_avg_sq,
                  int num_threads, const std::string& variant) {
  check_threads(num_threads);
  const KernelTable& kernels = select_variant(variant);
  AdamState s = adam_state(param, exp_avg, exp_avg_sq);
  TensorArg g = tensor_arg(grad, "grad");
  require_dtype(g, {DType::f32});
  require_same_numel(s.param, g);
  require_disjoint_from_state(g, s);
  py::gil_scoped_release no_gil;
  kernels.adam_traffic(static_cast<float*>(s.param.data), static_cast<const float*>(g.data),
                       static_cast<float*>(s.exp_avg.data), static_cast<float*>(s.exp_avg_sq.data),
                       s.param.numel, num_threads);
}

}  // namespace fxstar
