"""DRAM and PM devices: sizes, the PM header, persistence through both libpmem and mmap paths."""

import os
import subprocess
import sys

import numpy as np
import pytest

from cachedarrays import DRAM, PM, PMFormatError, parse_size
from cachedarrays.devices import libpmem
from cachedarrays.devices.perf import PROFILES


@pytest.mark.parametrize("text,value", [("512MiB", 512 << 20), ("2GiB", 2 << 30), ("4096", 4096),
                                        (" 1.5 KiB", 1536), ("3GB", 3 * 10**9), (1234, 1234)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "", "-4MiB", 0, -1, True, 3.5])
def test_parse_size_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="size|capacity"):
        parse_size(bad)


def test_dram_is_aligned_and_writable():
    d = DRAM("1MiB", bandwidth="ddr4")
    assert d.capacity == 1 << 20 and d.address() % 4096 == 0
    off = d.allocate(4096)
    d.view(off, 4096)[:] = 7
    assert d.view(off, 4096).sum() == 7 * 4096
    assert d.bandwidth == PROFILES["ddr4"]
    d.close()
    for call in (lambda: d.allocate(64), lambda: d.room_possible(64)):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_pm_default_location_is_a_scratch_file_removed_at_close():
    p = PM(capacity="1MiB")
    path = p.path
    assert os.path.exists(path) and p.bandwidth == PROFILES["optane"]
    p.close()
    assert not os.path.exists(path)


def _roundtrip(tmp_path, use_libpmem):
    path = tmp_path / "pool.pm"
    p = PM(path, "2MiB", use_libpmem=use_libpmem)
    assert p.uses_libpmem == bool(use_libpmem)
    off = p.allocate(100_000)
    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8)
    p.view(off, data.size)[:] = data
    p.persist(off, data.size)
    p.close()
    q = PM(path)  # reopen: capacity read from the header
    assert q.reopened and q.capacity == 2 << 20
    assert np.array_equal(q.view(off, data.size), data)
    q.close()
    assert path.exists()  # a named pool is kept


def test_pm_persist_close_reopen_with_mmap(tmp_path):
    _roundtrip(tmp_path, use_libpmem=False)


@pytest.mark.skipif(libpmem.load() is None, reason="libpmem1 is not installed (.ci/run installs it)")
def test_pm_persist_close_reopen_with_libpmem(tmp_path):
    _roundtrip(tmp_path, use_libpmem=True)


@pytest.mark.skipif(libpmem.load() is None, reason="libpmem1 is not installed (.ci/run installs it)")
def test_pm_forced_pmem_path_uses_pmem_persist(tmp_path):
    code = (
        "import numpy as np; from cachedarrays import PM; p = PM(r'%s', '1MiB');"
        "assert p.uses_libpmem and p.is_pmem, (p.uses_libpmem, p.is_pmem);"
        "o = p.allocate(4096); p.view(o, 4096)[:] = 5; p.persist(o, 4096); p.close()" % (tmp_path / "f.pm")
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PMEM_IS_PMEM_FORCE": "1"})
    q = PM(tmp_path / "f.pm", use_libpmem=False)
    assert (q.view(0, 4096) == 5).all()
    q.close()


def test_setting_disables_libpmem(tmp_path):
    code = "from cachedarrays import PM; p = PM(None, '1MiB'); print(p.uses_libpmem); p.close()"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={**os.environ, "CACHEDARRAYS_LIBPMEM": "0"}).stdout
    assert out.strip() == "False"


def test_pm_refuses_foreign_files_without_touching_them(tmp_path):
    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(b"hello world, this is not a pool at all" * 10)
    before = foreign.read_bytes()
    with pytest.raises(PMFormatError, match="not a cachedarrays PM pool"):
        PM(foreign, "1MiB")
    tiny = tmp_path / "tiny.pm"
    tiny.write_bytes(b"x")
    with pytest.raises(PMFormatError, match="too small"):
        PM(tiny)
    assert foreign.read_bytes() == before and tiny.read_bytes() == b"x"


def test_pm_refuses_wrong_capacity_and_truncated_pools(tmp_path):
    path = tmp_path / "pool.pm"
    PM(path, "1MiB").close()
    with pytest.raises(PMFormatError, match="capacity"):
        PM(path, "2MiB")
    with open(path, "r+b") as f:
        f.truncate(4096 + 1000)
    with pytest.raises(PMFormatError, match="truncated"):
        PM(path)


def test_pm_missing_or_unwritable_directory(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PM(tmp_path / "no" / "such" / "dir" / "pool.pm", "1MiB")
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root ignores mode bits; simulate what the kernel says to others
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, m: False if os.fspath(p) == str(ro) else real_access(p, m))
    else:
        ro.chmod(0o555)
    with pytest.raises(PermissionError, match="not writable"):
        PM(ro, "1MiB")
    assert list(ro.iterdir()) == []


def test_pm_capacity_not_understood(tmp_path):
    with pytest.raises(ValueError, match="cannot understand size"):
        PM(tmp_path, "a lot")


def test_a_stream_waits_for_running_copies_and_makes_its_telemetry_mark_only_for_them(monkeypatch):
    """`devices.gpu.wait_on_stream` with ``mark`` a function (as a JAX import passes it: making the
    mark costs a marker computation): called once, and only when a copy is still running; the mark
    becomes that copy's consumer point; finished copies and uses are waited for without one."""
    import types

    from cachedarrays.devices import gpu
    from cachedarrays.engine import Completion

    class Event:
        def __init__(self, done=False):
            self.done = done

    class Stream:
        def __init__(self):
            self.waited = []

        def wait_event(self, event):
            self.waited.append(event)

    monkeypatch.setattr(gpu, "cupy", lambda: types.SimpleNamespace())  # the function mark needs no CuPy

    def copy(done):
        c = Completion("DRAM", "GPU", 64)
        c.finish(cuda_start=Event(True), cuda_end=Event(done))
        return c

    made = []

    def make_mark():
        made.append(Event())
        return made[-1]

    finished, use = copy(True), types.SimpleNamespace(cuda_event=Event())
    stream = Stream()
    gpu.wait_on_stream([finished, use], stream, make_mark)
    assert made == [] and stream.waited == [use.cuda_event] and finished.gpu_uses == []
    running, other = copy(False), copy(False)
    stream = Stream()
    gpu.wait_on_stream([finished, running, other], stream, make_mark)
    assert len(made) == 1 and running.gpu_uses == other.gpu_uses == made
    assert stream.waited == [running.cuda_end, other.cuda_end]


def test_exposed_copy_time_counts_only_stream_waits_that_were_reached(monkeypatch):
    """A copy's exposed time is read from the events of the stream waits after it, and CUDA times
    only completed events: a wait a copier thread adds after the copy was found reaped (its consumer
    not there yet) is left out rather than timed (timing it raised cudaErrorNotReady)."""
    from cachedarrays.devices import gpu
    from cachedarrays.engine import Completion

    class Event:
        def __init__(self, t, done=True):
            self.t, self.done = t, done

    timed = []

    def elapsed(start, end):
        if not (start.done and end.done):
            raise RuntimeError("cudaErrorNotReady: device not ready")
        timed.append(start)
        return end.t - start.t

    monkeypatch.setattr(gpu, "elapsed", elapsed)
    c = Completion("DRAM", "GPU", 64)
    c.finish(cuda_start=Event(0.0), cuda_end=Event(5.0))
    reached, later = Event(2.0), Event(1.0, done=False)
    c.gpu_uses += [reached, later]
    assert c.exposed() == 3.0 and timed == [reached]
    c.waited = 4.0  # a host wait longer than any stream's
    assert c.exposed() == 4.0


def test_a_page_locked_heap_is_unregistered_before_its_memory_goes_also_when_never_closed(monkeypatch):
    """:func:`~cachedarrays.devices.gpu.pagelock` registers a host heap with CUDA until
    :func:`~cachedarrays.devices.gpu.pageunlock`; a heap dropped without it (a manager never
    closed) is unregistered when the array owning its memory is collected, before the memory is
    unmapped (a registration left over unmapped addresses would catch a later heap mapped there),
    and only once. Here CUDA's runtime is a recorder."""
    import gc
    import types

    from cachedarrays.devices import gpu
    calls = []
    runtime = types.SimpleNamespace(hostRegister=lambda addr, n, flags: calls.append(("register", addr, n, flags)),
                                    hostUnregister=lambda addr: calls.append(("unregister", addr)))
    monkeypatch.setattr(gpu, "cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    dev = DRAM("1MiB", bandwidth=(10, 10))
    addr = dev.address(0)
    view = dev.buffer[4096:8192]  # a view (as a table's rows are) keeps the memory, and the registration
    assert gpu.pagelock(dev) and dev.page_locked and gpu.pagelock(dev)
    assert calls == [("register", addr, 1 << 20, gpu.HOST_REGISTER_FLAGS)]
    mapping = dev._mmap
    del dev
    gc.collect()
    assert len(calls) == 1 and not mapping.closed
    del view
    gc.collect()
    assert calls[1:] == [("unregister", addr)]

    calls.clear()
    dev = DRAM("1MiB", bandwidth=(10, 10))
    gpu.pagelock(dev)
    gpu.pageunlock(dev)
    assert not dev.page_locked and [c[0] for c in calls] == ["register", "unregister"]
    gpu.pageunlock(dev)
    dev.close()
    del dev
    gc.collect()
    assert [c[0] for c in calls] == ["register", "unregister"]  # once only


def test_a_failed_unregistration_at_a_collection_is_a_warning(monkeypatch):
    """A heap collected unclosed whose unregistration CUDA refuses warns, naming the heap (a
    collection has no caller to raise into)."""
    import gc
    import types

    from cachedarrays.devices import gpu

    def refuse(addr):
        raise RuntimeError("cudaErrorHostMemoryNotRegistered")
    runtime = types.SimpleNamespace(hostRegister=lambda addr, n, flags: None, hostUnregister=refuse)
    monkeypatch.setattr(gpu, "cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    dev = DRAM("1MiB", bandwidth=(10, 10), name="heap")
    gpu.pagelock(dev)
    with pytest.warns(RuntimeWarning, match="heap: its host memory could not be unregistered from CUDA"):
        del dev
        gc.collect()
