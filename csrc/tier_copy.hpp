// Copies between host-reachable buffers of the same dtype and size: a chunk between its host
// home and its compute-tier block on a CPU-only machine, a gradient into its chunk's buffer.
// torch's copy_ forks its whole OpenMP team for such a copy, and a fork/join waits for every
// thread of the team: on a busy machine one descheduled thread stalls the copy for a scheduler
// slice (seen crawling at 0.5 GB/s). Here the caller copies blocks itself while at most a few
// helper threads take blocks from the same counter; the caller waits only for blocks a helper
// is in the middle of, never for a helper to wake up. The GIL is released throughout.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>

namespace fxstar {

// The unit of work: large enough that claiming one costs nothing beside its memcpy, small
// enough that waiting for a helper's last one is short. Bounds are page multiples.
constexpr int64_t kCopyBlockBytes = int64_t{1} << 20;
// From this size on the copy streams (non-temporal stores): its destination would not stay in
// cache anyway, and not reading it first saves a third of the traffic (1.4-1.5x memcpy's speed
// from 16 MiB on this project's host; at 4 MiB no difference).
constexpr int64_t kStreamingCopyBytes = int64_t{8} << 20;

// dst <- src. Both contiguous, in host memory, float32/bfloat16/float16, the same dtype and
// element count, not overlapping; otherwise a TypeError or ValueError naming the argument.
// num_threads counts the caller (1: a plain memcpy); it is clamped like the Adam kernels'.
void copy_into(pybind11::handle dst, pybind11::handle src, int64_t num_threads);

}  // namespace fxstar
