// fxstar._C's disk I/O: argument checks before anything is queued (a bad call raises and
// touches no file), the GIL released wherever a call can block, and every failure raised as
// fxstar.errors.DiskIOError with the file, offset, bytes and the system's reason.
#include "disk_io_bindings.hpp"

#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "disk_io.hpp"
#include "tensor_arg.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace fxstar {
namespace {

[[noreturn]] void raise_disk_error(const DiskFailure& f) {
  // imported when needed: fxstar.errors is plain Python that imports nothing of fxstar
  py::object cls = py::module_::import("fxstar.errors").attr("DiskIOError");
  py::object error_number = f.error != 0 ? py::object(py::int_(f.error)) : py::object(py::none());
  py::object exc = cls(describe(f), "operation"_a = f.operation, "path"_a = f.path,
                       "offset"_a = f.offset, "nbytes"_a = f.nbytes, "failed_at"_a = f.failed_at,
                       "errno"_a = error_number, "strerror"_a = f.reason);
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw py::error_already_set();
}

// The Python handle of one request: it owns the buffer's DLPack capsule, so the memory the
// I/O threads use lives at least as long as the request. Dropping a handle whose request is
// still running waits for it (a buffer must not be freed under a thread writing into it); a
// failure nobody waited for is handed to the engine, whose close() raises it.
class RequestHandle {
 public:
  RequestHandle(std::shared_ptr<DiskIO> engine, std::shared_ptr<DiskRequest> request,
                py::object keepalive)
      : engine_(std::move(engine)), request_(std::move(request)),
        keepalive_(std::move(keepalive)) {}

  ~RequestHandle() {
    if (!request_->done()) {
      py::gil_scoped_release no_gil;
      engine_->wait(*request_);
    }
    if (request_->failed() && !observed_) engine_->note_unobserved(request_->failure());
  }

  void wait() {
    if (!request_->done()) {
      py::gil_scoped_release no_gil;
      engine_->wait(*request_);
    }
    observed_ = true;
    if (request_->failed()) raise_disk_error(request_->failure());
  }

  bool done() const { return request_->done(); }
  const DiskRequest& request() const { return *request_; }

 private:
  std::shared_ptr<DiskIO> engine_;
  std::shared_ptr<DiskRequest> request_;
  py::object keepalive_;
  bool observed_ = false;
};

void require(bool ok, const std::string& message) {
  if (!ok) throw py::value_error(message);
}

std::unique_ptr<RequestHandle> submit(const std::shared_ptr<DiskIO>& engine,
                                      const std::shared_ptr<DiskFile>& file, int64_t offset,
                                      py::handle buffer, DiskRequest::Op op) {
  require(!engine->closed(), "the disk I/O engine is closed");
  ByteBuffer b = byte_buffer_arg(buffer, "buffer");
  require(offset >= 0, "offset: must not be negative, got " + std::to_string(offset));
  require(static_cast<uint64_t>(offset) <= (uint64_t{1} << 62) - b.nbytes,
          "offset: " + std::to_string(offset) + " + " + std::to_string(b.nbytes) +
              " bytes is beyond any file");
  const uint64_t a = file->alignment();
  if (a > 1) {
    const std::string why = " (the file was opened for direct I/O; open it with direct=False "
                            "for unaligned requests)";
    require(offset % a == 0, "offset: " + std::to_string(offset) + " is not a multiple of " +
                                 std::to_string(a) + why);
    require(b.nbytes % a == 0, "buffer: " + std::to_string(b.nbytes) +
                                   " bytes is not a multiple of " + std::to_string(a) + why);
    require(reinterpret_cast<uintptr_t>(b.data) % a == 0,
            "buffer: its address is not aligned to " + std::to_string(a) + " bytes" + why);
  }
  auto request = std::make_shared<DiskRequest>();
  request->op = op;
  request->file = file;
  request->offset = static_cast<uint64_t>(offset);
  request->data = b.data;
  request->nbytes = b.nbytes;
  bool closed = false;
  {
    py::gil_scoped_release no_gil;  // blocks while the queue is full
    try {
      engine->submit(request);
    } catch (const std::logic_error&) {
      closed = true;  // closed by another thread while this one waited for room
    }
  }
  require(!closed, "the disk I/O engine is closed");
  return std::make_unique<RequestHandle>(engine, request, std::move(b.keepalive));
}

const char* op_name(DiskRequest::Op op) { return op == DiskRequest::Op::read ? "read" : "write"; }

}  // namespace

void bind_disk_io(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const DiskError& e) {
      raise_disk_error(e.failure);
    }
  });
  m.attr("DISK_DIRECT_ALIGNMENT") = kDirectAlignment;

  py::class_<DiskFile, std::shared_ptr<DiskFile>>(
      m, "DiskFile",
      "One open file of a disk tier. nbytes >= 0 creates it if missing and grows it to nbytes "
      "with its blocks reserved, so a full disk is a DiskIOError here and not mid-step; "
      "nbytes=-1 opens an existing file as it is. direct=True asks for O_DIRECT; where the "
      "filesystem refuses it the file is buffered (see .direct), and requests must be aligned to "
      "DISK_DIRECT_ALIGNMENT either way.")
      .def(py::init([](const std::string& path, int64_t nbytes, bool direct) {
             py::gil_scoped_release no_gil;  // fallocate of a large file takes a while
             return std::make_shared<DiskFile>(path, nbytes, direct);
           }),
           "path"_a, "nbytes"_a = -1, "direct"_a = true)
      .def_property_readonly("path", &DiskFile::path)
      .def_property_readonly("direct", &DiskFile::direct,
                             "Whether O_DIRECT was granted (the page cache is bypassed).")
      .def_property_readonly("direct_requested", &DiskFile::direct_requested)
      .def_property_readonly("alignment", &DiskFile::alignment,
                             "What offsets, sizes and buffer addresses must be multiples of.")
      .def_property_readonly("size", &DiskFile::size)
      .def(
          "sync",
          [](const DiskFile& f) {
            py::gil_scoped_release no_gil;
            f.sync();
          },
          "fdatasync: the bytes written so far are on the device when it returns.")
      .def("__repr__", [](const DiskFile& f) {
        return "DiskFile(" + f.path() + ", direct=" + (f.direct() ? "True" : "False") + ")";
      });

  py::class_<RequestHandle>(m, "DiskIORequest",
                            "A queued read or write; wait() blocks without the GIL and raises "
                            "DiskIOError if it failed.")
      .def("wait", &RequestHandle::wait)
      .def_property_readonly("done", &RequestHandle::done)
      .def_property_readonly("operation",
                             [](const RequestHandle& h) { return op_name(h.request().op); })
      .def_property_readonly("path",
                             [](const RequestHandle& h) { return h.request().file->path(); })
      .def_property_readonly("offset", [](const RequestHandle& h) { return h.request().offset; })
      .def_property_readonly("nbytes", [](const RequestHandle& h) { return h.request().nbytes; });

  py::class_<DiskIO, std::shared_ptr<DiskIO>>(
      m, "DiskIO",
      "A pool of I/O threads reading and writing whole buffers at offsets in DiskFiles. At most "
      "queue_depth requests are in flight (submitting more blocks, without the GIL); each is cut "
      "into piece_bytes pieces the threads share. Requests are not ordered against each other.")
      .def(py::init([](int threads, int queue_depth, uint64_t piece_bytes) {
             try {
               return std::make_shared<DiskIO>(threads, queue_depth, piece_bytes);
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           "threads"_a = 2, "queue_depth"_a = 32, "piece_bytes"_a = uint64_t{8} << 20)
      .def(
          "read",
          [](const std::shared_ptr<DiskIO>& e, const std::shared_ptr<DiskFile>& f, int64_t offset,
             py::handle buffer) { return submit(e, f, offset, buffer, DiskRequest::Op::read); },
          "file"_a, "offset"_a, "buffer"_a,
          "Queue a read of len(buffer's bytes) from offset into buffer.")
      .def(
          "write",
          [](const std::shared_ptr<DiskIO>& e, const std::shared_ptr<DiskFile>& f, int64_t offset,
             py::handle buffer) { return submit(e, f, offset, buffer, DiskRequest::Op::write); },
          "file"_a, "offset"_a, "buffer"_a, "Queue a write of buffer's bytes at offset.")
      .def(
          "close",
          [](DiskIO& e) {
            {
              py::gil_scoped_release no_gil;
              e.close();
            }
            auto lost = e.take_unobserved();
            if (!lost.empty()) raise_disk_error(lost.front());
          },
          "Finish every queued request and stop the threads; raises DiskIOError for a failed "
          "request whose handle was dropped without wait().")
      .def_property_readonly("closed", &DiskIO::closed)
      .def_property_readonly("threads", &DiskIO::threads)
      .def_property_readonly("queue_depth", &DiskIO::queue_depth)
      .def_property_readonly("piece_bytes", &DiskIO::piece_bytes)
      .def("stats", [](const DiskIO& e) {
        const DiskIOStats s = e.stats();
        py::dict d;
        d["bytes_read"] = s.bytes_read;
        d["bytes_written"] = s.bytes_written;
        d["requests"] = s.requests;
        d["failures"] = s.failures;
        d["in_flight"] = s.in_flight;
        return d;
      });
}

}  // namespace fxstar
