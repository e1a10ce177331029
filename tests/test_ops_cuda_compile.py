"""The CUDA sources compile for sm_80 (A100) and sm_90 (H100, H200) without a GPU: the torch-free kernels with nvcc, the torch glue
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
# CI compiles the kernels on every run: there a missing nvcc fails the test instead of skipping it.
if NVCC is None and os.environ.get("CI", "").lower() == "true":
    raise RuntimeError("CI=true and nvcc is not on PATH: the CUDA sources must be compile-checked in CI")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA sources cannot be "
                                                     "compile-checked on this machine")
# One entry function per kernel instantiation, per source: the copy and 2 x 2 fills; 2 dtypes x 2 widths of quantize
# and of dequantize (which also sums a reduction's chunks).
KERNELS = {"cuda_layout.cu": 1 + 4, "cuda_quant.cu": 4 + 4}
ENTRY_POINTS = {"cuda_layout.cu": ["copy_segments", "fill_segments"],
                "cuda_quant.cu": ["quantize", "dequantize", "dequantize_reduce"]}
# The GPUs users train on: A100 (sm_80) and H100 / H200 (sm_90).
ARCHES = ["sm_80", "sm_90"]


def cuda_include() -> Path:
    """The CUDA toolkit's headers: beside nvcc, or where torch or the environment says CUDA is."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME,
                  str(Path(NVCC).resolve().parent.parent), "/usr/local/cuda"]
    for home in filter(None, candidates):
        if (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    pytest.fail(f"nvcc is at {NVCC} but no CUDA headers (include/cuda_runtime.h) were found in {candidates}")


def test_the_builder_compiles_every_cuda_source_checked_here():
    assert sorted(s for s in builder.CUDA_SOURCES if s.endswith(".cu")) == sorted(KERNELS)


@pytest.mark.parametrize("arch", ARCHES)
def test_cuda_sources_compile(tmp_path, arch):
    kernels = {}
    for source in KERNELS:
        obj = tmp_path / source.replace(".cu", ".o")
        kernels[source] = (obj, subprocess.Popen(
            [NVCC, f"-arch={arch}", *builder.CUDA_CFLAGS, "-Werror", "all-warnings", "-Xptxas", "-v", "-I", str(OPS),
             "-c", str(OPS / source), "-o", str(obj)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

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

    glue_log, _ = glue.communicate(timeout=300)
    assert glue.returncode == 0, glue_log[-4000:]
    total = 0
    for source, (obj, process) in kernels.items():
        log, _ = process.communicate(timeout=300)
        assert process.returncode == 0, log[-4000:]
        compiled = re.findall(rf"Compiling entry function '(\w+)' for '{arch}'", log)
        assert len(compiled) == KERNELS[source], (source, compiled)
        total += len(compiled)
        # The wide paths keep their words in registers: a register array indexed at run time would show as a
        # stack frame. (One quantize instantiation spills a few bytes around fp32 division's slow path.)
        frames = [int(b) for b in re.findall(r"(\d+) bytes stack frame", log)]
        assert len(frames) == KERNELS[source] and max(frames) <= 16, (source, frames)
        # Every entry point cuda_ops.cpp calls is defined, with the declared signature.
        symbols = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True).stdout
        for name in ENTRY_POINTS[source]:
            assert re.search(rf" T dsa::cuda::{name}\(", symbols), f"{name} is not defined by {source}"
    print(f"compiled {total} kernels for {arch} with {NVCC}; cuda_ops.cpp checked with torch "
          f"{sys.modules['torch'].__version__} headers", file=sys.stderr)
