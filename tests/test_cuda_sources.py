"""The CUDA sources of the GPU kernels compile: with NVRTC alone (the ``nvidia-cuda-nvrtc-cu12``
wheel of the test extras; no driver, no GPU), so that CI, which has no GPU, catches a kernel that
would not build; a broken source would take down every kernel compiled with it. The kernels'
behaviour is tested on a GPU (marked ``gpu``) against their numpy forms."""

from __future__ import annotations

import ctypes
import glob
import os
import re

import pytest

ARCH = "compute_90"  # the H100's


def _nvrtc():
    try:
        import nvidia.cuda_nvrtc
    except ImportError:
        return None
    libs = sorted(lib for root in nvidia.cuda_nvrtc.__path__  # a namespace package: no __file__
                  for lib in glob.glob(os.path.join(root, "lib", "libnvrtc.so.*")))
    return ctypes.CDLL(libs[0]) if libs else None


NVRTC = _nvrtc()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="NVRTC's wheel is only published for Linux x86_64 and aarch64")


def ptx(name: str, source: str) -> str:
    """``source`` compiled to PTX as CuPy compiles it (C++14), or AssertionError with NVRTC's log."""
    lib = NVRTC
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) == 0
    opts = [b"--std=c++14", f"--gpu-architecture={ARCH}".encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, f"{name} does not compile:\n{log.value.decode()}"
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, out)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.value.decode()


def entries(text: str) -> set[str]:
    return set(re.findall(r"\.entry\s+(\w+)", text))


def test_a_broken_source_is_reported_with_nvrtcs_log():
    with pytest.raises(AssertionError, match="undefined_thing"):
        ptx("broken", 'extern "C" __global__ void f() { undefined_thing = 1; }')


@pytest.mark.parametrize("module,kernels", [
    ("embeddings.gpu.cuda", {"pooled_v4_i32", "pooled_v1_i64", "sorted_rows_i32", "long_rows_i64", "chunk_sums_v4",
                             "update_long_v4_i32", "update_short_v1_i64", "check_i32"}),
    ("embeddings.gpu.lru_kernels", {"lru_distinct", "lru_copy_v4", "lru_copy_v1"}),
    ("embeddings.gpu.lru_group", {"tb_probe", "tb_count", "tb_victims", "tb_moves", "tb_move_v4", "tb_move_v1",
                                  "tb_gather_v4", "tb_gather_v1", "tb_put_v4", "tb_put_v1", "tb_settle"}),
])
def test_every_cuda_source_compiles_with_the_kernels_its_launchers_name(module, kernels):
    import importlib
    source = importlib.import_module(module).SOURCE
    got = entries(ptx(module, source))
    assert kernels <= got, f"missing: {sorted(kernels - got)}"
