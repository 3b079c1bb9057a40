// The Python-facing CPU Adam: argument checks (through DLPack), then the kernel of the selected
// variant with the GIL released.
#pragma once
#include <pybind11/pybind11.h>

#include <string>
#include <utility>

namespace fxstar {

void adam_step(pybind11::handle param, pybind11::handle grad, pybind11::handle exp_avg,
               pybind11::handle exp_avg_sq, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, bool adamw, double grad_scale,
               pybind11::handle out, int num_threads, const std::string& variant);

std::pair<double, bool> grad_stats(pybind11::handle grad, int num_threads,
                                   const std::string& variant);

void adam_traffic(pybind11::handle param, pybind11::handle grad, pybind11::handle exp_avg,
                  pybind11::handle exp_avg_sq, int num_threads, const std::string& variant);

}  // namespace fxstar
