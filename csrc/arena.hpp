// An offset allocator over a fixed capacity: the budget of one memory tier. It hands out offsets
// only; Python owns the single big buffer (a torch tensor on the tier's device) and makes views at
// those offsets, so the same allocator serves a cuda tier and the CPU arena of CPU-only machines.
//
// Policy: best fit (the smallest free block that holds the request; the lowest offset among equal
// sizes), allocation at the block's start, and coalescing with both neighbours on free.
#pragma once
#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

namespace fxstar {

struct ArenaOutOfMemory : std::runtime_error {
  ArenaOutOfMemory(const std::string& msg, uint64_t requested, uint64_t free_bytes,
                   uint64_t largest_free)
      : std::runtime_error(msg),
        requested(requested),
        free_bytes(free_bytes),
        largest_free(largest_free) {}
  uint64_t requested, free_bytes, largest_free;
};

struct ArenaStats {
  uint64_t capacity = 0;
  uint64_t alignment = 0;
  uint64_t in_use = 0;  // bytes of live blocks, rounded up to the alignment
  uint64_t peak_in_use = 0;
  uint64_t free_bytes = 0;
  uint64_t largest_free = 0;
  double fragmentation = 0.0;  // 1 - largest_free / free_bytes: 0 when all free bytes are one block
  uint64_t live_blocks = 0;
  uint64_t free_blocks = 0;
  uint64_t total_allocs = 0;
  uint64_t total_frees = 0;
  uint64_t failed_allocs = 0;
};

class Arena {
 public:
  static constexpr uint64_t kMinAlignment = 256;

  // `capacity` is rounded down to a multiple of `alignment` (a power of two, at least 256).
  explicit Arena(uint64_t capacity, uint64_t alignment = kMinAlignment);

  uint64_t alloc(int64_t nbytes);   // throws ArenaOutOfMemory, std::invalid_argument
  void free(uint64_t offset);       // throws std::invalid_argument on an unknown offset
  uint64_t block_size(uint64_t offset) const;
  bool owns(uint64_t offset) const { return used_.count(offset) != 0; }
  ArenaStats stats() const;
  void reset_peak() { peak_ = in_use_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t in_use() const { return in_use_; }
  uint64_t round_up(uint64_t nbytes) const { return (nbytes + alignment_ - 1) & ~(alignment_ - 1); }

 private:
  void add_free(uint64_t offset, uint64_t size);
  void remove_free(uint64_t offset, uint64_t size);

  uint64_t capacity_;
  uint64_t alignment_;
  uint64_t in_use_ = 0;
  uint64_t peak_ = 0;
  uint64_t total_allocs_ = 0, total_frees_ = 0, failed_allocs_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;             // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;    // (size, offset)
  std::unordered_map<uint64_t, uint64_t> used_;             // offset -> size
};

std::string format_bytes(uint64_t nbytes);

}  // namespace fxstar
