#include "tier_copy.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "cpu_adam.hpp"
#include "tensor_arg.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>  // SSE2: part of every x86-64 CPU, so no variant is needed
#define FXSTAR_STREAMING_STORES 1
#else
#define FXSTAR_STREAMING_STORES 0
#endif

namespace py = pybind11;

namespace fxstar {
namespace {

// memcpy with non-temporal stores: the destination lines are written without being read
// first (2 bytes of traffic per byte copied, not 3) and without evicting the cache. glibc
// streams only above a threshold it derives from the shared cache size, which virtual machines
// report too large (320 MiB on this project's host, so 240 MiB), above every chunk's size.
void copy_streaming(char* to, const char* from, size_t n) {
#if FXSTAR_STREAMING_STORES
  const size_t head = std::min(n, (64 - (reinterpret_cast<uintptr_t>(to) & 63)) & 63);
  std::memcpy(to, from, head);
  to += head;
  from += head;
  n -= head;
  const size_t body = n & ~size_t{63};
  for (size_t i = 0; i < body; i += 64) {  // one cache line a step, four 16-byte stores
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 48), d);
  }
  _mm_sfence();  // streamed stores are weakly ordered: visible before the block counts as done
  std::memcpy(to + body, from + body, n - body);
#else
  std::memcpy(to, from, n);
#endif
}

// One copy, split in blocks that whoever comes first claims.
struct CopyJob {
  char* to;
  const char* from;
  int64_t nbytes;
  int64_t blocks;
  int helpers;                    // helpers that may join (the caller is not counted)
  bool streaming;                 // non-temporal stores (large copies)
  std::atomic<int64_t> next{0};   // the next block to claim
  std::atomic<int64_t> done{0};   // blocks copied
  std::atomic<int> joined{0};     // helpers that took part

  void run() {
    for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < blocks;) {
      const int64_t lo = b * kCopyBlockBytes, hi = std::min(nbytes, lo + kCopyBlockBytes);
      if (streaming) {
        copy_streaming(to + lo, from + lo, static_cast<size_t>(hi - lo));
      } else {
        std::memcpy(to + lo, from + lo, static_cast<size_t>(hi - lo));
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Helper threads that sleep until a copy is posted. Never destroyed (the interpreter may exit
// with them asleep), and never needed for correctness: the caller copies every block nobody
// else claimed, so a helper that wakes late, or not at all (after a fork), only costs speed.
class CopyHelpers {
 public:
  static CopyHelpers& get() {
    static CopyHelpers* helpers = new CopyHelpers();
    return *helpers;
  }

  // Offer the job to up to job->helpers helpers; false when the lock is busy (the caller then
  // copies alone rather than wait for it).
  void post(const std::shared_ptr<CopyJob>& job) {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return;
    try {
      while (static_cast<int>(threads_) < job->helpers) {
        std::thread(&CopyHelpers::serve, this).detach();
        ++threads_;
      }
    } catch (const std::system_error&) {
      // no more threads to be had (a process limit): those there are, or the caller alone
    }
    job_ = job;
    ++generation_;
    lock.unlock();
    wake_.notify_all();
  }

 private:
  void serve() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<CopyJob> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      // a job keeps its own memory alive; its buffers are touched only through claimed blocks,
      // which the caller waits for
      if (job && job->joined.fetch_add(1) < job->helpers) job->run();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::shared_ptr<CopyJob> job_;
  uint64_t generation_ = 0;
  size_t threads_ = 0;
};

}  // namespace

void copy_into(py::handle dst, py::handle src, int64_t num_threads) {
  const int threads = checked_threads(num_threads);
  TensorArg d = tensor_arg(dst, "dst");
  TensorArg s = tensor_arg(src, "src");
  if (d.dtype != s.dtype) {
    throw py::type_error(std::string("dst and src: dtypes differ (") + dtype_name(d.dtype) +
                         " and " + dtype_name(s.dtype) + "); this copy does not convert");
  }
  require_same_numel(d, s);
  require_disjoint(d, s);
  const int64_t nbytes = static_cast<int64_t>(d.nbytes());
  if (nbytes == 0) return;
  auto job = std::make_shared<CopyJob>();
  job->to = static_cast<char*>(d.data);
  job->from = static_cast<const char*>(s.data);
  job->nbytes = nbytes;
  job->blocks = (nbytes + kCopyBlockBytes - 1) / kCopyBlockBytes;
  job->helpers = static_cast<int>(std::min<int64_t>(threads - 1, job->blocks - 1));
  job->streaming = nbytes >= kStreamingCopyBytes;
  py::gil_scoped_release no_gil;
  if (job->helpers > 0) CopyHelpers::get().post(job);
  job->run();
  // only blocks a helper is copying right now are left: wait for them, not for sleepers
  while (job->done.load(std::memory_order_acquire) < job->blocks) std::this_thread::yield();
}

}  // namespace fxstar
