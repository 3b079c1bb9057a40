// The Python-facing CPU Adam: argument checks (through DLPack), then the kernel of the selected
// variant with the GIL released.
#pragma once
#include <pybind11/pybind11.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "kernels/kernels.hpp"
#include "tensor_arg.hpp"

namespace fxstar {

// num_threads above max_threads() is clamped to it: OpenMP starts every thread it is asked for,
// and 100000 of them crash the process. Results do not depend on the count (except the order of
// grad_stats' sum), so clamping changes nothing but the time.
constexpr int kThreadsPerCore = 4;
int max_threads();  // kThreadsPerCore x the hardware threads (at least 1 of them)
// At least 1 (a ValueError below); a larger request than max_threads() is clamped to it, since
// OpenMP would try to start every thread asked for (100000 crash the process, 2**31-1 abort it).
int checked_threads(int64_t num_threads);

// The hyperparameters checked (a ValueError names the first one out of range).
AdamHyper checked_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                        int64_t step, bool adamw, double grad_scale);

// The optional low-precision copy of the updated parameter: bf16 or fp16, param's size,
// disjoint from the state; it may be the gradient itself, otherwise disjoint from it.
struct CopyOut {
  TensorArg arg;
  void* data = nullptr;
  DType dtype = DType::bf16;
};
CopyOut checked_out(pybind11::handle out, const TensorArg& param, const TensorArg& grad,
                    std::initializer_list<const TensorArg*> state);

void adam_step(pybind11::handle param, pybind11::handle grad, pybind11::handle exp_avg,
               pybind11::handle exp_avg_sq, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, bool adamw, double grad_scale,
               pybind11::handle out, int64_t num_threads, const std::string& variant);

std::pair<double, bool> grad_stats(pybind11::handle grad, int64_t num_threads,
                                   const std::string& variant);

void adam_traffic(pybind11::handle param, pybind11::handle grad, pybind11::handle exp_avg,
                  pybind11::handle exp_avg_sq, int64_t num_threads, const std::string& variant);

}  // namespace fxstar
