#include "arena.hpp"

#include <cstdio>
#include <iterator>

namespace fxstar {

std::string format_bytes(uint64_t nbytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(nbytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(nbytes));
  else
    std::snprintf(buf, sizeof buf, "%.2f %s (%llu bytes)", v, units[u],
                  static_cast<unsigned long long>(nbytes));
  return buf;
}

Arena::Arena(uint64_t capacity, uint64_t alignment) : alignment_(alignment) {
  if (alignment < kMinAlignment || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("alignment: must be a power of two of at least 256 bytes, got " +
                                std::to_string(alignment));
  }
  capacity_ = capacity & ~(alignment - 1);
  if (capacity_ == 0) {
    throw std::invalid_argument("capacity: must hold at least one aligned block of " +
                                std::to_string(alignment) + " bytes, got " +
                                std::to_string(capacity));
  }
  add_free(0, capacity_);
}

void Arena::add_free(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void Arena::remove_free(uint64_t offset, uint64_t size) {
  free_by_offset_.erase(offset);
  free_by_size_.erase({size, offset});
}

uint64_t Arena::alloc(int64_t nbytes) {
  if (nbytes <= 0) {
    throw std::invalid_argument("nbytes: must be positive, got " + std::to_string(nbytes));
  }
  const uint64_t size = round_up(static_cast<uint64_t>(nbytes));
  auto it = size >= static_cast<uint64_t>(nbytes) ? free_by_size_.lower_bound({size, 0})
                                                    : free_by_size_.end();
  if (it == free_by_size_.end()) {
    ++failed_allocs_;
    const uint64_t free_bytes = capacity_ - in_use_;
    const uint64_t largest = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
    throw ArenaOutOfMemory("arena cannot allocate " + format_bytes(static_cast<uint64_t>(nbytes)) +
                               ": " + format_bytes(free_bytes) + " free of " +
                               format_bytes(capacity_) + ", largest free block " +
                               format_bytes(largest),
                           static_cast<uint64_t>(nbytes), free_bytes, largest);
  }
  const auto [block_size, offset] = *it;
  remove_free(offset, block_size);
  if (block_size > size) add_free(offset + size, block_size - size);
  used_.emplace(offset, size);
  in_use_ += size;
  if (in_use_ > peak_) peak_ = in_use_;
  ++total_allocs_;
  return offset;
}

void Arena::free(uint64_t offset) {
  auto it = used_.find(offset);
  if (it == used_.end()) {
    throw std::invalid_argument("offset " + std::to_string(offset) +
                                " is not a live allocation of this arena (freed twice, or never "
                                "returned by alloc)");
  }
  uint64_t start = offset, size = it->second;
  used_.erase(it);
  in_use_ -= size;
  ++total_frees_;

  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      remove_free(prev->first, prev->second);
    }
  }
  next = free_by_offset_.lower_bound(start + size);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    remove_free(next->first, next->second);
  }
  add_free(start, size);
}

uint64_t Arena::block_size(uint64_t offset) const {
  auto it = used_.find(offset);
  if (it == used_.end()) {
    throw std::invalid_argument("offset " + std::to_string(offset) +
                                " is not a live allocation of this arena");
  }
  return it->second;
}

ArenaStats Arena::stats() const {
  ArenaStats s;
  s.capacity = capacity_;
  s.alignment = alignment_;
  s.in_use = in_use_;
  s.peak_in_use = peak_;
  s.free_bytes = capacity_ - in_use_;
  s.largest_free = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  s.fragmentation =
      s.free_bytes == 0 ? 0.0 : 1.0 - static_cast<double>(s.largest_free) / s.free_bytes;
  s.live_blocks = used_.size();
  s.free_blocks = free_by_offset_.size();
  s.total_allocs = total_allocs_;
  s.total_frees = total_frees_;
  s.failed_allocs = failed_allocs_;
  return s;
}

}  // namespace fxstar
