#include "tensor_arg.hpp"

#include <Python.h>

#include <sstream>

#include "dlpack.hpp"

namespace py = pybind11;

namespace fxstar {
namespace {

[[noreturn]] void type_error(const std::string& msg) { throw py::type_error(msg); }
[[noreturn]] void value_error(const std::string& msg) { throw py::value_error(msg); }

std::string describe_dtype(const DLDataType& t) {
  std::ostringstream s;
  switch (t.code) {
    case kDLInt: s << "int"; break;
    case kDLUInt: s << "uint"; break;
    case kDLFloat: s << "float"; break;
    case kDLBfloat: s << "bfloat"; break;
    case kDLBool: s << "bool"; break;
    default: s << "code" << int(t.code);
  }
  s << int(t.bits);
  if (t.lanes != 1) s << "x" << t.lanes;
  return s.str();
}

DType to_dtype(const DLDataType& t, const char* name) {
  if (t.lanes == 1) {
    if (t.code == kDLFloat && t.bits == 32) return DType::f32;
    if (t.code == kDLFloat && t.bits == 16) return DType::f16;
    if (t.code == kDLBfloat && t.bits == 16) return DType::bf16;
  }
  type_error(std::string(name) + ": unsupported dtype " + describe_dtype(t) +
             " (expected float32, bfloat16 or float16)");
}

std::string describe_device(const DLDevice& d) {
  switch (d.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost: return "cuda pinned host";
    default: return "device type " + std::to_string(d.device_type);
  }
}

bool is_contiguous(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

// The checks every argument passes first: exported through DLPack, in host memory.
// Returns the (unconsumed) capsule; its DLTensor stays valid while the capsule lives.
py::object exported(py::handle obj, const char* name, const DLTensor** tensor) {
  if (obj.is_none()) type_error(std::string(name) + ": expected a tensor, got None");
  py::object capsule;
  if (PyCapsule_CheckExact(obj.ptr())) {
    capsule = py::reinterpret_borrow<py::object>(obj);
  } else if (py::hasattr(obj, "__dlpack__")) {
    try {
      capsule = obj.attr("__dlpack__")();
    } catch (py::error_already_set& e) {
      type_error(std::string(name) + ": could not be exported through DLPack (" + e.what() +
                 "); pass a plain, detached tensor");
    }
  } else {
    type_error(std::string(name) + ": expected a tensor (an object with __dlpack__), got " +
               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    type_error(std::string(name) +
               ": DLPack capsule is not an unconsumed 'dltensor' (was it used already?)");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const DLTensor& t = managed->dl_tensor;
  if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDAHost) {
    value_error(std::string(name) + ": must be in host memory, got a tensor on " +
                describe_device(t.device) + " (move it to the CPU first)");
  }
  *tensor = &t;
  return capsule;
}

void require_contiguous(const DLTensor& t, const char* name) {
  if (!is_contiguous(t)) {
    value_error(std::string(name) + ": must be contiguous (call .contiguous() first)");
  }
}

int64_t numel_of(const DLTensor& t) {
  int64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) numel *= t.shape[i];
  return numel;
}

}  // namespace

TensorArg tensor_arg(py::handle obj, const char* name) {
  const DLTensor* dl = nullptr;
  py::object capsule = exported(obj, name, &dl);
  const DLTensor& t = *dl;
  TensorArg arg;
  arg.name = name;
  arg.dtype = to_dtype(t.dtype, name);
  require_contiguous(t, name);
  arg.numel = numel_of(t);
  arg.data = static_cast<char*>(t.data) + t.byte_offset;
  if (arg.numel > 0 && arg.data == nullptr) value_error(std::string(name) + ": has no data");
  if (reinterpret_cast<uintptr_t>(arg.data) % itemsize(arg.dtype) != 0) {
    value_error(std::string(name) + ": data is not aligned to its element size");
  }
  // The capsule stays unconsumed: its destructor returns the producer's reference.
  arg.keepalive = std::move(capsule);
  return arg;
}

ByteBuffer byte_buffer_arg(py::handle obj, const char* name) {
  const DLTensor* dl = nullptr;
  py::object capsule = exported(obj, name, &dl);
  const DLTensor& t = *dl;
  const uint64_t bits = uint64_t{t.dtype.bits} * t.dtype.lanes;
  if (bits == 0 || bits % 8 != 0) {
    type_error(std::string(name) + ": dtype " + describe_dtype(t.dtype) +
               " does not fill whole bytes");
  }
  require_contiguous(t, name);
  ByteBuffer arg;
  arg.name = name;
  arg.nbytes = static_cast<uint64_t>(numel_of(t)) * (bits / 8);
  arg.dtype = describe_dtype(t.dtype);
  arg.data = static_cast<char*>(t.data) + t.byte_offset;
  if (arg.nbytes > 0 && arg.data == nullptr) value_error(std::string(name) + ": has no data");
  arg.keepalive = std::move(capsule);
  return arg;
}

void require_disjoint(const TensorArg& a, const TensorArg& b) {
  if (a.numel == 0 || b.numel == 0) return;
  auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  if (a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes()) {
    value_error(a.name + " and " + b.name + " overlap in memory; they must be separate buffers");
  }
}

void require_same_numel(const TensorArg& a, const TensorArg& b) {
  if (a.numel != b.numel) {
    value_error(b.name + ": has " + std::to_string(b.numel) + " elements but " + a.name + " has " +
                std::to_string(a.numel) + "; they must match");
  }
}

void require_dtype(const TensorArg& t, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string names;
  for (DType d : allowed) names += std::string(names.empty() ? "" : " or ") + dtype_name(d);
  type_error(t.name + ": dtype " + dtype_name(t.dtype) + " not allowed here (expected " + names +
             ")");
}

}  // namespace fxstar
