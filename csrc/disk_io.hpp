// Asynchronous file I/O for a disk tier: whole buffers read from and written to offsets in files
// by a small pool of I/O threads, so the CPU Adam can update one chunk while the next is read and
// the last is written. Plain pread/pwrite on threads, not io_uring: for the megabyte requests a
// chunk makes, a few threads keep a disk's queue as full as io_uring would, and need nothing
// beyond POSIX to build. Nothing here touches Python; the bindings (disk_io_bindings.cpp) check
// arguments, release the GIL and turn failures into fxstar.errors.DiskIOError.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fxstar {

// What O_DIRECT may ask of offsets, sizes and buffer addresses: the largest logical block size
// of common disks, so one rule holds on every filesystem.
constexpr uint64_t kDirectAlignment = 4096;

// A failed open, read, write or sync, with what is needed to name it.
struct DiskFailure {
  std::string operation;  // "open", "read", "write", "sync"
  std::string path;
  uint64_t offset = 0;     // of the request in the file
  uint64_t nbytes = 0;     // of the request
  uint64_t failed_at = 0;  // the file offset where the transfer stopped
  int error = 0;           // errno; 0 for a short transfer, which has none
  std::string reason;      // strerror, or what was short
};

// Thrown by DiskFile's constructor and sync; the bindings raise it as DiskIOError.
struct DiskError : std::exception {
  explicit DiskError(DiskFailure f);
  const char* what() const noexcept override { return message.c_str(); }
  DiskFailure failure;
  std::string message;
};

std::string describe(const DiskFailure& f);

// One open file. `nbytes` >= 0 creates the file if missing and grows it to nbytes with its
// blocks reserved (fallocate where the filesystem has it), so a full disk is found here rather
// than in the middle of a step; nbytes < 0 opens an existing file as it is. `direct` asks for
// O_DIRECT (the page cache bypassed: a disk tier's bytes are read once per step, caching them
// only takes host memory); where the filesystem refuses it the file is opened buffered and
// direct() says so. Requests on a file opened with direct=true must be aligned to
// kDirectAlignment whichever mode was granted, so code tested on one filesystem runs on another.
class DiskFile {
 public:
  DiskFile(std::string path, int64_t nbytes, bool direct);
  ~DiskFile();
  DiskFile(const DiskFile&) = delete;
  DiskFile& operator=(const DiskFile&) = delete;

  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  bool direct_requested() const { return direct_requested_; }
  bool direct() const { return direct_; }
  uint64_t alignment() const { return direct_requested_ ? kDirectAlignment : 1; }
  uint64_t size() const;  // the file's size now (fstat)
  void sync() const;      // fdatasync: written bytes are on the device when it returns

 private:
  std::string path_;
  int fd_ = -1;
  bool direct_requested_ = false;
  bool direct_ = false;
};

// One read or write of a whole buffer, split into pieces the threads take in order.
struct DiskRequest {
  enum class Op { read, write };
  Op op;
  std::shared_ptr<DiskFile> file;
  uint64_t offset;
  char* data;
  uint64_t nbytes;

  bool done() const { return done_.load(std::memory_order_acquire); }
  bool failed() const { return failed_; }  // meaningful once done()
  const DiskFailure& failure() const { return failure_; }

 private:
  friend class DiskIO;
  std::atomic<int64_t> pieces_left_{0};
  std::atomic<bool> done_{false};
  std::mutex failure_mutex_;
  bool failed_ = false;
  DiskFailure failure_;  // the failed piece of lowest offset
};

struct DiskIOStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t requests = 0;
  uint64_t failures = 0;
  int64_t in_flight = 0;
};

class DiskIO {
 public:
  // `threads` I/O threads; at most `queue_depth` requests submitted and not finished (submit
  // blocks beyond it); requests are cut into pieces of `piece_bytes` so several threads work on
  // one large buffer at once.
  DiskIO(int threads, int queue_depth, uint64_t piece_bytes);
  ~DiskIO();  // close()
  DiskIO(const DiskIO&) = delete;
  DiskIO& operator=(const DiskIO&) = delete;

  // Queues the request; blocks while queue_depth requests are in flight. Requests are not
  // ordered against each other: wait for a write before reading what it wrote.
  void submit(const std::shared_ptr<DiskRequest>& request);
  void wait(const DiskRequest& request);
  // Finishes every queued request, then stops and joins the threads; submit afterwards throws.
  void close();
  bool closed() const;

  int threads() const { return static_cast<int>(threads_.size()); }
  int queue_depth() const { return queue_depth_; }
  uint64_t piece_bytes() const { return piece_bytes_; }
  DiskIOStats stats() const;

  // A failed request whose caller let go of it without waiting: kept so that closing the
  // engine can still raise it rather than lose it.
  void note_unobserved(const DiskFailure& failure);
  std::vector<DiskFailure> take_unobserved();

 private:
  struct Piece {
    std::shared_ptr<DiskRequest> request;
    uint64_t begin, end;  // bytes of the request's buffer
  };
  void run();
  // `skipped`: not attempted, since another piece of its request failed already
  void finish_piece(const Piece& piece, uint64_t transferred, int error, bool skipped);

  const int queue_depth_;
  const uint64_t piece_bytes_;
  mutable std::mutex mutex_;
  std::condition_variable work_ready_, space_free_, request_done_;
  std::deque<Piece> pieces_;
  int64_t in_flight_ = 0;
  bool closing_ = false;
  DiskIOStats stats_;
  std::vector<DiskFailure> unobserved_;
  std::vector<std::thread> threads_;
};

}  // namespace fxstar
