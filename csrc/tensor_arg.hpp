// Tensors cross into the core through DLPack, so the C++ side sees dtype, shape, strides and
// device itself and can refuse a bad call with an error that names the argument.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "dtype.hpp"

namespace fxstar {

struct TensorArg {
  std::string name;
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t numel = 0;
  pybind11::object keepalive;  // the DLPack capsule: owns a reference to the producer's tensor

  size_t nbytes() const { return static_cast<size_t>(numel) * itemsize(dtype); }
};

// Takes any object with __dlpack__ (or a "dltensor" capsule). Requires host-reachable memory and
// a contiguous layout; raises TypeError/ValueError naming `name` otherwise.
TensorArg tensor_arg(pybind11::handle obj, const char* name);

// The bytes of a tensor of any dtype, for code that moves bytes without reading them (file I/O).
struct ByteBuffer {
  std::string name;
  char* data = nullptr;
  uint64_t nbytes = 0;
  std::string dtype;           // as DLPack describes it: "uint8", "float32", ...
  pybind11::object keepalive;  // as TensorArg's
};

// Takes any object with __dlpack__ whose elements are whole bytes; the same checks as
// tensor_arg but any dtype.
ByteBuffer byte_buffer_arg(pybind11::handle obj, const char* name);

// Raises ValueError naming both arguments when their bytes overlap.
void require_disjoint(const TensorArg& a, const TensorArg& b);
void require_same_numel(const TensorArg& a, const TensorArg& b);
void require_dtype(const TensorArg& t, std::initializer_list<DType> allowed);

}  // namespace fxstar
