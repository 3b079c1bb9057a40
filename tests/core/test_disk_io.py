"""The C++ disk I/O engine: bytes come back bitwise, failures are named DiskIOErrors (never
zeros), bad arguments raise before anything is queued, waits release the GIL, threads stop."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from fxstar import DiskIOError
from fxstar.runtime.disk_io import (
    DIRECT_ALIGNMENT,
    DiskFile,
    DiskIO,
    aligned_buffer,
    aligned_size,
)

A = DIRECT_ALIGNMENT


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    buffer = aligned_buffer(nbytes)
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=seeded(seed)))
    return buffer


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def engine():
    with DiskIO(threads=3, queue_depth=4, piece_bytes=64 << 10) as io:
        yield io


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_is_bitwise(tmp_path, engine, direct):
    nbytes = aligned_size(3_000_001)  # several pieces and a partial last one
    file = DiskFile(str(tmp_path / "part"), nbytes, direct=direct)
    assert file.size == nbytes and file.direct_requested is direct
    written = random_bytes(nbytes, seed=1)
    engine.write(file, 0, written).wait()
    read = aligned_buffer(nbytes, zero=True)
    engine.read(file, 0, read).wait()
    assert torch.equal(read, written)
    assert engine.stats()["bytes_read"] == nbytes and engine.stats()["bytes_written"] == nbytes


def test_any_dtype_moves_as_bytes(tmp_path, engine):
    file = DiskFile(str(tmp_path / "typed"), 3 * A)
    values = [
        torch.randn(A // 4, generator=seeded(2)),
        torch.randn(A // 2, generator=seeded(3)).to(torch.bfloat16),
        torch.arange(A // 8, dtype=torch.int64),
    ]
    for i, v in enumerate(values):
        staged = aligned_buffer(A).view(v.dtype).copy_(v)
        engine.write(file, i * A, staged).wait()
    for i, v in enumerate(values):
        back = aligned_buffer(A, zero=True).view(v.dtype)
        engine.read(file, i * A, back).wait()
        assert torch.equal(back.view(torch.uint8), v.view(torch.uint8))


def test_unaligned_requests_on_a_buffered_file(tmp_path, engine):
    file = DiskFile(str(tmp_path / "buffered"), 1000, direct=False)
    assert file.alignment == 1 and not file.direct
    data = np.frombuffer(os.urandom(333), dtype=np.uint8).copy()  # numpy: DLPack works too
    engine.write(file, 7, data).wait()
    back = np.zeros(333, dtype=np.uint8)
    engine.read(file, 7, back).wait()
    assert np.array_equal(back, data)


def test_many_requests_in_flight_at_once(tmp_path):
    rng = np.random.default_rng(0)
    sizes = [int(s) * A for s in rng.integers(1, 40, size=120)]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    order = rng.permutation(len(sizes))
    file = DiskFile(str(tmp_path / "many"), sum(sizes))
    written = [random_bytes(n, seed=10 + i) for i, n in enumerate(sizes)]
    with DiskIO(threads=4, queue_depth=3, piece_bytes=16 << 10) as io:
        pending = []
        for i in order:
            pending.append(io.write(file, offsets[i], written[i]))
            assert io.stats()["in_flight"] <= 3  # the queue is bounded
        for request in pending:
            request.wait()
        read = [aligned_buffer(n, zero=True) for n in sizes]
        pending = [io.read(file, offsets[i], read[i]) for i in order]
        for request in pending:
            request.wait()
    for w, r in zip(written, read):
        assert torch.equal(w, r)


def test_a_waited_write_is_what_the_next_read_sees(tmp_path, engine):
    file = DiskFile(str(tmp_path / "region"), 8 * A)
    back = aligned_buffer(4 * A)
    for round_ in range(30):
        data = random_bytes(4 * A, seed=100 + round_)
        engine.write(file, 2 * A, data).wait()
        engine.read(file, 2 * A, back).wait()
        assert torch.equal(back, data), round_


def test_a_read_past_the_end_is_a_short_read(tmp_path, engine):
    file = DiskFile(str(tmp_path / "short"), 4 * A)
    buffer = aligned_buffer(4 * A).fill_(0xAB)
    with pytest.raises(DiskIOError, match="short read: the file ends at byte 16384") as caught:
        engine.read(file, 2 * A, buffer).wait()
    e = caught.value
    assert (e.operation, e.path, e.offset, e.nbytes) == ("read", file.path, 2 * A, 4 * A)
    assert e.failed_at == 4 * A and e.errno is None and isinstance(e, OSError)
    with pytest.raises(DiskIOError, match="ends at byte 16384"):
        engine.read(file, 100 * A, buffer).wait()  # nothing at all to read


def test_a_vanished_directory(tmp_path, engine):
    directory = tmp_path / "state"
    directory.mkdir()
    open_before = DiskFile(str(directory / "kept"), A)
    data = random_bytes(A, seed=5)
    engine.write(open_before, 0, data).wait()
    shutil.rmtree(directory)
    with pytest.raises(DiskIOError) as caught:
        DiskFile(str(directory / "new"), A)
    assert caught.value.errno == errno.ENOENT and caught.value.operation == "open"
    assert str(directory / "new") in str(caught.value)
    # a file opened before keeps its bytes: the open descriptor still reaches them
    back = aligned_buffer(A, zero=True)
    engine.read(open_before, 0, back).wait()
    assert torch.equal(back, data)


def test_opening_a_missing_file_without_a_size(tmp_path):
    with pytest.raises(DiskIOError, match="No such file") as caught:
        DiskFile(str(tmp_path / "absent"))
    assert caught.value.errno == errno.ENOENT
    assert not (tmp_path / "absent").exists()


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """RLIMIT_FSIZE for this process, with SIGXFSZ ignored so that writing beyond it fails
    with EFBIG instead of killing the process."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_file_size_limit_is_efbig_at_open_and_at_write(tmp_path, engine):
    # EFBIG, the errno a full quota-like limit gives; ENOSPC itself is tested on a tiny tmpfs
    small = tmp_path / "small"
    small.write_bytes(b"")  # opened as it is: no reservation, so the write meets the limit
    file = DiskFile(str(small))
    data = random_bytes(8 * A, seed=7)
    with file_size_limit(4 * A):
        with pytest.raises(DiskIOError) as at_open:
            DiskFile(str(tmp_path / "big"), 8 * A)
        with pytest.raises(DiskIOError) as at_write:
            engine.write(file, 0, data).wait()
    assert at_open.value.errno == errno.EFBIG and at_open.value.operation == "open"
    assert not (tmp_path / "big").exists()  # the file it could not size is not left behind
    e = at_write.value
    assert e.errno == errno.EFBIG and e.operation == "write" and e.failed_at == 4 * A
    assert "File too large" in str(e) and str(small) in str(e)


@functools.cache
def namespaces_available() -> bool:
    """Whether this user may mount in a user namespace (unshare -rm), for a tiny tmpfs and a
    read-only bind mount without root."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


def in_namespace(mounts: str, code: str) -> dict:
    """Runs `code` (Python printing one JSON line) after the shell commands `mounts`, in a user
    and mount namespace of its own."""
    prologue = (
        "import errno, json, os, torch\n"
        "from fxstar import DiskIOError\n"
        "from fxstar.runtime.disk_io import DiskFile, DiskIO, aligned_buffer\n"
    )
    script = f"{mounts} && exec {shlex.quote(sys.executable)} -c {shlex.quote(prologue + code)}"
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_namespaces = pytest.mark.skipif(
    not namespaces_available(), reason="cannot mount in a user namespace here (unshare -rm)"
)


@needs_namespaces
def test_a_full_disk_is_enospc_at_open_and_at_write(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = in_namespace(
        f"mount -t tmpfs -o size=256k tmpfs {mount}",
        f"""
out = {{}}
try:
    DiskFile("{mount}/reserved", 1 << 20)
except DiskIOError as e:
    out["open"] = [e.errno, e.operation, os.path.exists("{mount}/reserved")]
open("{mount}/grown", "wb").close()
file = DiskFile("{mount}/grown")
with DiskIO() as io:
    try:
        io.write(file, 0, aligned_buffer(1 << 20).fill_(1)).wait()
    except DiskIOError as e:
        out["write"] = [e.errno, e.operation, e.failed_at, str(e)]
print(json.dumps(out))
""",
    )
    assert result["open"] == [errno.ENOSPC, "open", False]
    code, operation, failed_at, message = result["write"]
    assert (code, operation) == (errno.ENOSPC, "write")
    assert 0 < failed_at <= 256 << 10 and "No space left on device" in message


@needs_namespaces
def test_a_read_only_directory(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    (directory / "existing").write_bytes(bytes(A))
    result = in_namespace(
        f"mount --bind {directory} {directory} && mount -o remount,ro,bind {directory}",
        f"""
out = {{}}
for name, size in (("new", 4096), ("existing", -1)):
    try:
        DiskFile("{directory}/" + name, size)
    except DiskIOError as e:
        out[name] = [e.errno, e.operation]
print(json.dumps(out))
""",
    )
    assert result == {"new": [errno.EROFS, "open"], "existing": [errno.EROFS, "open"]}


@needs_namespaces
def test_a_filesystem_without_direct_io_falls_back_to_buffered(tmp_path):
    mount = tmp_path / "ramfs"
    mount.mkdir()
    result = in_namespace(
        f"mount -t ramfs ramfs {mount}",
        f"""
file = DiskFile("{mount}/part", 8192)
data = aligned_buffer(8192).random_(0, 256)
back = aligned_buffer(8192, zero=True)
with DiskIO() as io:
    io.write(file, 0, data).wait()
    io.read(file, 0, back).wait()
    try:
        io.write(file, 100, data[:4096])
        misaligned = None
    except ValueError as e:
        misaligned = str(e)
print(json.dumps([file.direct, file.alignment, torch.equal(data, back), misaligned]))
""",
    )
    direct, alignment, equal, misaligned = result
    assert direct is False and alignment == A and equal  # alignment holds whatever was granted
    assert "offset: 100 is not a multiple of 4096" in misaligned


def test_bad_arguments_raise_before_anything_is_queued(tmp_path, engine):
    file = DiskFile(str(tmp_path / "args"), 4 * A)
    buffer = aligned_buffer(2 * A)
    with pytest.raises(ValueError, match="offset: 100 is not a multiple of 4096"):
        engine.write(file, 100, buffer)
    with pytest.raises(ValueError, match="buffer: 4095 bytes is not a multiple of 4096"):
        engine.write(file, 0, buffer[:4095])
    with pytest.raises(ValueError, match="address is not aligned"):
        engine.write(file, 0, buffer[1 : 1 + A])
    with pytest.raises(ValueError, match="contiguous"):
        engine.write(file, 0, buffer.view(2, A).t())
    with pytest.raises(ValueError, match="offset: must not be negative"):
        engine.read(file, -A, buffer)
    with pytest.raises(TypeError, match="buffer: expected a tensor"):
        engine.write(file, 0, b"bytes")
    with pytest.raises(TypeError, match="buffer: could not be exported"):
        engine.write(file, 0, torch.zeros(A // 4, requires_grad=True))
    assert engine.stats()["requests"] == 0
    for kwargs, match in [
        ({"threads": 0}, "threads"),
        ({"queue_depth": 0}, "queue_depth"),
        ({"piece_bytes": 1000}, "piece_bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            DiskIO(**kwargs)


def test_a_closed_engine_refuses_work(tmp_path):
    io = DiskIO()
    io.close()
    io.close()  # twice is fine
    assert io.closed
    with pytest.raises(ValueError, match="closed"):
        io.read(DiskFile(str(tmp_path / "f"), A), 0, aligned_buffer(A))


def test_a_wait_releases_the_gil(tmp_path):
    """Another Python thread runs while the main thread waits: its clock readings fall inside
    the wait. Holding the GIL would leave none there but at the very edges."""
    sys_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    stop = threading.Event()
    ticks: list[float] = []

    def count() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    counter = threading.Thread(target=count)
    counter.start()
    try:
        with DiskIO(threads=1) as io:
            nbytes = 64 << 20
            while True:
                file = DiskFile(str(tmp_path / f"gil{nbytes}"), nbytes)
                request = io.write(file, 0, aligned_buffer(nbytes, zero=True))
                start = time.perf_counter()
                request.wait()
                end = time.perf_counter()
                if end - start > 0.05 or nbytes >= 1 << 30:
                    break
                nbytes *= 2
    finally:
        stop.set()
        counter.join()
        sys.setswitchinterval(sys_interval)
    assert end - start > 0.02, "the write was too fast to tell"
    inside = [t for t in ticks if start + 0.005 < t < end - 0.005]
    assert len(inside) > 100


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_threads_stop_at_close_and_at_collection(tmp_path):
    before = task_count()
    io = DiskIO(threads=3)
    assert task_count() == before + 3
    io.close()
    assert task_count() == before
    io = DiskIO(threads=2)
    assert task_count() == before + 2
    del io  # never closed: the threads stop when it is collected
    assert task_count() == before


def test_a_dropped_request_finishes_and_its_failure_is_raised_at_close(tmp_path):
    file = DiskFile(str(tmp_path / "dropped"), 2 * A)
    io = DiskIO(threads=1)
    data = random_bytes(2 * A, seed=9)
    io.write(file, 0, data)  # handle dropped at once: waits for the write, keeps the buffer
    back = aligned_buffer(2 * A, zero=True)
    io.read(file, 0, back).wait()
    assert torch.equal(back, data)
    io.read(file, 2 * A, aligned_buffer(A))  # fails (past the end) with nobody waiting
    with pytest.raises(DiskIOError, match="short read"):
        io.close()
