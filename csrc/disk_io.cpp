#include "disk_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace fxstar {
namespace {

// One pread/pwrite moves at most this much (Linux stops at 2 GiB - 4 KiB); the loop goes on.
constexpr uint64_t kMaxTransfer = uint64_t{1} << 30;

[[noreturn]] void fail(const std::string& operation, const std::string& path, uint64_t offset,
                       uint64_t nbytes, int error) {
  throw DiskError({operation, path, offset, nbytes, offset, error, std::strerror(error)});
}

int open_file(const std::string& path, int flags, bool direct) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
  return fd;
}

}  // namespace

std::string describe(const DiskFailure& f) {
  std::string s = f.operation + " of " + std::to_string(f.nbytes) + " bytes at offset " +
                  std::to_string(f.offset) + " of " + f.path;
  if (f.operation == "open") s = "open of " + f.path + " (" + std::to_string(f.nbytes) + " bytes)";
  if (f.operation == "sync") s = "sync of " + f.path;
  if (f.failed_at != f.offset) s += " failed at byte " + std::to_string(f.failed_at);
  else s += " failed";
  s += ": " + f.reason;
  if (f.error != 0) s += " (errno " + std::to_string(f.error) + ")";
  return s;
}

DiskError::DiskError(DiskFailure f) : failure(std::move(f)), message(describe(failure)) {}

DiskFile::DiskFile(std::string path, int64_t nbytes, bool direct)
    : path_(std::move(path)), direct_requested_(direct) {
  const uint64_t size = nbytes < 0 ? 0 : static_cast<uint64_t>(nbytes);
  // Opened without O_CREAT first, so a file this call creates is known and removed again when
  // it cannot be given its size.
  bool created = false;
  auto open_as = [&](bool with_direct) {
    fd_ = open_file(path_, O_RDWR, with_direct);
    if (fd_ < 0 && errno == ENOENT && nbytes >= 0) {
      fd_ = open_file(path_, O_RDWR | O_CREAT | O_EXCL, with_direct);
      // a filesystem without direct I/O creates the file before it refuses O_DIRECT
      created = fd_ >= 0 || (errno == EINVAL && ::access(path_.c_str(), F_OK) == 0);
      if (fd_ < 0 && created) errno = EINVAL;
    }
  };
  if (direct) {
    open_as(true);
    direct_ = fd_ >= 0;
    // EINVAL: the filesystem has no direct I/O (ramfs, some FUSE); buffered I/O still works
    if (fd_ < 0 && errno != EINVAL) fail("open", path_, 0, size, errno);
  }
  if (fd_ < 0) {
    const bool created_before = created;
    open_as(false);
    created = created || created_before;
  }
  if (fd_ < 0) fail("open", path_, 0, size, errno);
  if (nbytes >= 0 && this->size() < size) {
    int error = 0;
    if (::fallocate(fd_, 0, 0, static_cast<off_t>(size)) != 0) {
      error = errno;
      // no reservation on this filesystem: the size alone, blocks come with the writes
      if (error == EOPNOTSUPP || error == ENOSYS)
        error = ::ftruncate(fd_, static_cast<off_t>(size)) == 0 ? 0 : errno;
    }
    if (error != 0) {
      ::close(fd_);
      fd_ = -1;
      if (created) ::unlink(path_.c_str());
      fail("open", path_, 0, size, error);
    }
  }
}

DiskFile::~DiskFile() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t DiskFile::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail("stat", path_, 0, 0, errno);
  return static_cast<uint64_t>(st.st_size);
}

void DiskFile::sync() const {
  if (::fdatasync(fd_) != 0) fail("sync", path_, 0, 0, errno);
}

DiskIO::DiskIO(int threads, int queue_depth, uint64_t piece_bytes)
    : queue_depth_(queue_depth), piece_bytes_(piece_bytes) {
  if (threads < 1) throw std::invalid_argument("threads: must be at least 1");
  if (queue_depth < 1) throw std::invalid_argument("queue_depth: must be at least 1");
  if (piece_bytes == 0 || piece_bytes % kDirectAlignment != 0) {
    throw std::invalid_argument("piece_bytes: must be a positive multiple of " +
                                std::to_string(kDirectAlignment));
  }
  threads_.reserve(static_cast<size_t>(threads));
  try {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
  } catch (...) {
    close();
    throw;
  }
}

DiskIO::~DiskIO() { close(); }

void DiskIO::submit(const std::shared_ptr<DiskRequest>& request) {
  const uint64_t n = request->nbytes;
  const uint64_t count = (n + piece_bytes_ - 1) / piece_bytes_;
  std::unique_lock<std::mutex> lock(mutex_);
  space_free_.wait(lock, [&] { return closing_ || in_flight_ < queue_depth_; });
  if (closing_) throw std::logic_error("the disk I/O engine is closed");
  ++stats_.requests;
  if (count == 0) {
    request->done_.store(true, std::memory_order_release);
    return;
  }
  request->pieces_left_.store(static_cast<int64_t>(count), std::memory_order_relaxed);
  ++in_flight_;
  for (uint64_t i = 0; i < count; ++i) {
    pieces_.push_back({request, i * piece_bytes_, std::min(n, (i + 1) * piece_bytes_)});
  }
  lock.unlock();
  if (count == 1) work_ready_.notify_one();
  else work_ready_.notify_all();
}

void DiskIO::wait(const DiskRequest& request) {
  if (request.done()) return;
  std::unique_lock<std::mutex> lock(mutex_);
  request_done_.wait(lock, [&] { return request.done(); });
}

void DiskIO::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
  }
  work_ready_.notify_all();
  space_free_.notify_all();
  // the threads leave only once the queue is empty: every request submitted is finished
  for (std::thread& t : threads_)
    if (t.joinable()) t.join();
}

bool DiskIO::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closing_;
}

DiskIOStats DiskIO::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  DiskIOStats s = stats_;
  s.in_flight = in_flight_;
  return s;
}

void DiskIO::note_unobserved(const DiskFailure& failure) {
  std::lock_guard<std::mutex> lock(mutex_);
  unobserved_.push_back(failure);
}

std::vector<DiskFailure> DiskIO::take_unobserved() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(unobserved_, {});
}

void DiskIO::run() {
  for (;;) {
    Piece piece;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return closing_ || !pieces_.empty(); });
      if (pieces_.empty()) return;
      piece = std::move(pieces_.front());
      pieces_.pop_front();
    }
    DiskRequest& r = *piece.request;
    bool skip;
    {
      std::lock_guard<std::mutex> lock(r.failure_mutex_);
      skip = r.failed_;  // another piece failed already: the request fails whatever this does
    }
    uint64_t done = 0;
    int error = 0;
    const uint64_t length = piece.end - piece.begin;
    const int fd = r.file->fd();
    while (!skip && done < length) {
      const size_t chunk = static_cast<size_t>(std::min(length - done, kMaxTransfer));
      char* at = r.data + piece.begin + done;
      const off_t position = static_cast<off_t>(r.offset + piece.begin + done);
      const ssize_t moved = r.op == DiskRequest::Op::read ? ::pread(fd, at, chunk, position)
                                                          : ::pwrite(fd, at, chunk, position);
      if (moved < 0) {
        if (errno == EINTR) continue;
        error = errno;
        break;
      }
      if (moved == 0) break;  // the file ended (read) or the device took nothing (write)
      done += static_cast<uint64_t>(moved);
    }
    finish_piece(piece, done, error, skip);
  }
}

void DiskIO::finish_piece(const Piece& piece, uint64_t transferred, int error, bool skipped) {
  DiskRequest& r = *piece.request;
  const uint64_t length = piece.end - piece.begin;
  if (!skipped && (transferred < length || error != 0)) {
    DiskFailure f;
    f.operation = r.op == DiskRequest::Op::read ? "read" : "write";
    f.path = r.file->path();
    f.offset = r.offset;
    f.nbytes = r.nbytes;
    f.failed_at = r.offset + piece.begin + transferred;
    f.error = error;
    if (error != 0) {
      f.reason = std::strerror(error);
    } else if (r.op == DiskRequest::Op::read) {
      uint64_t size = 0;
      try {
        size = r.file->size();
      } catch (const DiskError&) {
      }
      f.reason = "short read: the file ends at byte " + std::to_string(size);
    } else {
      f.reason = "short write: the device accepted no more bytes";
    }
    std::lock_guard<std::mutex> lock(r.failure_mutex_);
    if (!r.failed_ || f.failed_at < r.failure_.failed_at) r.failure_ = std::move(f);
    r.failed_ = true;
  }
  if (r.pieces_left_.fetch_sub(1, std::memory_order_acq_rel) != 1) {
    std::lock_guard<std::mutex> lock(mutex_);
    (r.op == DiskRequest::Op::read ? stats_.bytes_read : stats_.bytes_written) += transferred;
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    (r.op == DiskRequest::Op::read ? stats_.bytes_read : stats_.bytes_written) += transferred;
    if (r.failed_) ++stats_.failures;
    --in_flight_;
    // under the lock, so a waiter that saw it not done is already waiting when it is notified
    r.done_.store(true, std::memory_order_release);
  }
  request_done_.notify_all();
  space_free_.notify_one();
}

}  // namespace fxstar
