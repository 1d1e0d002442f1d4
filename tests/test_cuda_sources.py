"""The CUDA sources of the GPU kernels compile: with NVRTC alone (the ``nvidia-cuda-nvrtc-cu12``
wheel of the test extras; no driver, no GPU), so that CI, which has no GPU, catches a kernel that
would not build; a broken source would take down every kernel compiled with it. The kernels'
behaviour is tested on a GPU (marked ``gpu``) against their numpy forms."""

from __future__ import annotations

import ast
import ctypes
import glob
import os
import re

import pytest

ARCH = "compute_90"  # the H100's
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


LAUNCHERS = {"embeddings.gpu.cuda": "embeddings/gpu/backend.py",  # module with the source: the code launching it
             "embeddings.gpu.lru_kernels": "embeddings/gpu/lru_kernels.py",
             "embeddings.gpu.lru_group": "embeddings/gpu/lru_group.py",
             "cnn.inplace": "cnn/inplace.py"}


def launched(path: str) -> set[str]:
    """The kernel names ``path`` launches, as patterns: its string literals spelled like a kernel
    name (``tb_probe``), f-strings with each field read as a word (``tb_move_{vt}`` -> ``tb_move_\\w+``)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = re.escape(node.value)
        elif isinstance(node, ast.JoinedStr):
            text = "".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+" for v in node.values)
        else:
            continue
        if re.fullmatch(r"[a-z]+(_([a-z0-9]+|\\w\+))+", text):
            names.add(text)
    return names


def test_the_launcher_scan_reads_literals_and_fstrings():
    assert {"tb_probe", r"tb_move_\w+", "tb_move_v1"} <= launched(LAUNCHERS["embeddings.gpu.lru_group"])
    assert r"pooled_\w+_\w+" in launched(LAUNCHERS["embeddings.gpu.cuda"])


@pytest.mark.parametrize("module", sorted(LAUNCHERS))
def test_every_cuda_source_compiles_with_the_kernels_its_launcher_names_and_no_others(module):
    import importlib
    got = entries(ptx(module, importlib.import_module(module).SOURCE))
    wanted = launched(LAUNCHERS[module])
    missing = [w for w in wanted if not any(re.fullmatch(w, e) for e in got)]
    unused = [e for e in got if not any(re.fullmatch(w, e) for w in wanted)]
    assert not missing, f"launched but not compiled: {sorted(missing)}"
    assert not unused, f"compiled but never launched: {sorted(unused)}"
