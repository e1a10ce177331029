"""The CUDA sources compile for sm_90 (Hopper) without a GPU: the torch-free kernels with nvcc, the torch glue
with the host compiler against torch's headers. Machines without a GPU can then not break the CUDA build
unnoticed; running the kernels needs a GPU (`asynchzp-ops-bench --device cuda`).
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from ds_asynchzp.ops import builder

OPS = Path(__file__).resolve().parent.parent / "ops"
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA sources cannot be "
                                                     "compile-checked on this machine")
# One entry function per kernel instantiation: copy, 2 x 2 fill, and 2 dtypes x 2 widths of quantize,
# dequantize and dequantize_reduce.
KERNELS = 1 + 4 + 3 * 4
ENTRY_POINTS = ["copy_units", "fill_units", "quantize", "dequantize", "dequantize_reduce"]


def cuda_include() -> Path:
    """The CUDA toolkit's headers: beside nvcc, or where torch or the environment says CUDA is."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME,
                  str(Path(NVCC).resolve().parent.parent), "/usr/local/cuda"]
    for home in filter(None, candidates):
        if (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    pytest.fail(f"nvcc is at {NVCC} but no CUDA headers (include/cuda_runtime.h) were found in {candidates}")


def test_cuda_sources_compile_for_sm90(tmp_path):
    obj = tmp_path / "cuda_kernels.o"
    kernels = subprocess.Popen([NVCC, "-arch=sm_90", *builder.CUDA_CFLAGS, "-Werror", "all-warnings", "-Xptxas",
                                "-v", "-I", str(OPS), "-c", str(OPS / "cuda_kernels.cu"), "-o", str(obj)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # The glue includes c10/cuda headers; a CPU-only torch ships them without the one header its CUDA build
    # generates, which only defines how c10_cuda was linked: a stand-in lets the rest be checked.
    includes = cpp_extension.include_paths() + [str(cuda_include()), sysconfig.get_path("include")]
    generated = "c10/cuda/impl/cuda_cmake_macros.h"
    if not any((Path(p) / generated).is_file() for p in includes):
        shim = tmp_path / "shim" / generated
        shim.parent.mkdir(parents=True)
        shim.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path / "shim"))
    glue = subprocess.Popen(["c++", "-std=c++20", "-fsyntax-only", *builder.CFLAGS, "-I", str(OPS),
                             *[f"-isystem{p}" for p in includes], str(OPS / "cuda_ops.cpp")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    kernel_log, _ = kernels.communicate(timeout=300)
    glue_log, _ = glue.communicate(timeout=300)
    assert kernels.returncode == 0, kernel_log[-4000:]
    assert glue.returncode == 0, glue_log[-4000:]
    compiled = re.findall(r"Compiling entry function '(\w+)' for 'sm_90'", kernel_log)
    assert len(compiled) == KERNELS, compiled

    # Every entry point cuda_ops.cpp calls is defined by the kernels' object file, with the declared signature.
    symbols = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True).stdout
    for name in ENTRY_POINTS:
        assert re.search(rf" T dsa::cuda::{name}\(", symbols), f"{name} is not defined by cuda_kernels.cu"
    print(f"compiled {len(compiled)} kernels for sm_90 with {NVCC}; cuda_ops.cpp checked with torch "
          f"{sys.modules['torch'].__version__} headers", file=sys.stderr)
