// Aligned host memory that torch can use without a copy (exported through DLPack as a uint8
// tensor). The host tier's chunks live in such buffers; on CUDA machines Python pins them.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

namespace fxstar {

struct HostAllocation {
  HostAllocation(uint64_t nbytes, uint64_t alignment, bool zero);
  ~HostAllocation();
  HostAllocation(const HostAllocation&) = delete;
  HostAllocation& operator=(const HostAllocation&) = delete;
  void* data = nullptr;
  uint64_t nbytes = 0;
  uint64_t alignment = 0;
  bool huge_pages = false;
};

// The bytes of all host buffers alive now (as requested, before alignment): what the host tier
// holds, and how a test sees a buffer really given back.
uint64_t host_bytes_in_use();

class HostBuffer {
 public:
  // `alignment` 0 picks 4 KiB, or 2 MiB (with transparent huge pages advised) for large buffers.
  // `zero` false leaves the heap's old contents in place (the Python default is true).
  HostBuffer(int64_t nbytes, uint64_t alignment, bool zero);
  pybind11::capsule dlpack() const;  // a fresh "dltensor" capsule sharing ownership of the memory
  uint64_t nbytes() const { return alloc_->nbytes; }
  uint64_t alignment() const { return alloc_->alignment; }
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(alloc_->data); }
  bool huge_pages() const { return alloc_->huge_pages; }

 private:
  std::shared_ptr<HostAllocation> alloc_;
};

}  // namespace fxstar
