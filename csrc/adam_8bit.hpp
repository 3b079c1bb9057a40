// The CPU Adam with 8-bit blockwise-quantised moments (kernels/quant_map.hpp), and the
// conversions between such a moment and fp32 (a checkpoint in fp32, a state converted on load).
// Checks as adam_step's: a TypeError or ValueError naming the argument, never a crash.
#pragma once
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace fxstar {

// exp_avg_* and exp_avg_sq_*: codes uint8 of param's size, absmax fp32 of
// ceil(numel / kQuantBlock); the rest as adam_step.
void adam_step_8bit(pybind11::handle param, pybind11::handle grad,
                    pybind11::handle exp_avg_codes, pybind11::handle exp_avg_absmax,
                    pybind11::handle exp_avg_sq_codes, pybind11::handle exp_avg_sq_absmax,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    int64_t step, bool adamw, double grad_scale, pybind11::handle out,
                    int64_t num_threads, const std::string& variant);

// codes, absmax <- the quantised values (signed map for a first moment, unsigned for a second).
void quantize_moment(pybind11::handle values, pybind11::handle codes, pybind11::handle absmax,
                     bool is_signed);
// out <- code x absmax, fp32.
void dequantize_moment(pybind11::handle codes, pybind11::handle absmax, pybind11::handle out,
                       bool is_signed);

std::vector<float> quantization_map(bool is_signed);

}  // namespace fxstar
