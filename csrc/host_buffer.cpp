#include "host_buffer.hpp"

#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "arena.hpp"
#include "dlpack.hpp"

namespace py = pybind11;

namespace fxstar {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kHugePage = 2u << 20;
constexpr uint64_t kHugeThreshold = 32u << 20;

std::atomic<uint64_t> live_bytes{0};  // requested bytes of every HostAllocation alive

// What a DLPack capsule owns: the tensor description plus a share of the allocation, so the
// memory outlives the HostBuffer for as long as any torch tensor views it.
struct ExportedTensor {
  DLManagedTensor managed{};
  int64_t shape[1] = {0};
  int64_t strides[1] = {1};
  std::shared_ptr<HostAllocation> owner;
};

void delete_exported(DLManagedTensor* self) {
  delete static_cast<ExportedTensor*>(self->manager_ctx);
}

void capsule_destructor(PyObject* capsule) {
  // Only a capsule nobody consumed still carries the name "dltensor"; a consumer renames it.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (m && m->deleter) m->deleter(m);
  }
}

}  // namespace

HostAllocation::HostAllocation(uint64_t nbytes_, uint64_t alignment_, bool zero) {
  if (alignment_ == 0) alignment_ = nbytes_ >= kHugeThreshold ? kHugePage : kPage;
  if ((alignment_ & (alignment_ - 1)) != 0 || alignment_ < sizeof(void*)) {
    throw py::value_error("alignment: must be a power of two of at least " +
                          std::to_string(sizeof(void*)) + ", got " + std::to_string(alignment_));
  }
  const uint64_t rounded = (nbytes_ + alignment_ - 1) & ~(alignment_ - 1);
  void* p = nullptr;
  if (posix_memalign(&p, alignment_, rounded == 0 ? alignment_ : rounded) != 0) {
    throw std::bad_alloc();
  }
#ifdef MADV_HUGEPAGE
  if (alignment_ >= kHugePage && rounded >= kHugeThreshold) {
    huge_pages = madvise(p, rounded, MADV_HUGEPAGE) == 0;
  }
#endif
  if (zero) std::memset(p, 0, rounded);
  data = p;
  nbytes = nbytes_;
  alignment = alignment_;
  live_bytes += nbytes;
}

HostAllocation::~HostAllocation() {
  std::free(data);
  live_bytes -= nbytes;
}

uint64_t host_bytes_in_use() { return live_bytes.load(); }

HostBuffer::HostBuffer(int64_t nbytes, uint64_t alignment, bool zero) {
  if (nbytes < 0) {
    throw py::value_error("nbytes: must not be negative, got " + std::to_string(nbytes));
  }
  try {
    alloc_ = std::make_shared<HostAllocation>(static_cast<uint64_t>(nbytes), alignment, zero);
  } catch (const std::bad_alloc&) {
    PyErr_SetString(PyExc_MemoryError,
                    ("cannot allocate a host buffer of " + format_bytes(nbytes)).c_str());
    throw py::error_already_set();
  }
}

py::capsule HostBuffer::dlpack() const {
  auto* ex = new ExportedTensor();
  ex->owner = alloc_;
  ex->shape[0] = static_cast<int64_t>(alloc_->nbytes);
  DLTensor& t = ex->managed.dl_tensor;
  t.data = alloc_->data;
  t.device = {kDLCPU, 0};
  t.ndim = 1;
  t.dtype = {kDLUInt, 8, 1};
  t.shape = ex->shape;
  t.strides = ex->strides;
  t.byte_offset = 0;
  ex->managed.manager_ctx = ex;
  ex->managed.deleter = delete_exported;
  PyObject* cap = PyCapsule_New(&ex->managed, "dltensor", capsule_destructor);
  if (cap == nullptr) {
    delete ex;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

}  // namespace fxstar
