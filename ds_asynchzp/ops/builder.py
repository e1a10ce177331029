"""JIT build of the C++/CUDA ops: found, hashed, built with ninja once, cached, loaded; or the reference.

The sources are the top-level ``ops/`` of a checkout, or the copy a wheel ships as the package data
``ds_asynchzp/ops/csrc``. On first use the builder compiles them with ninja through
``torch.utils.cpp_extension.load`` into a cache directory keyed by a hash of the sources, the build flags and
the torch, Python and CUDA versions, so that a changed source or another torch rebuilds while every later
process (every rank of a job) loads the cached library in milliseconds. Only the CPU kernels are built where
CUDA is absent. The library registers its kernels under ``torch.ops.ds_asynchzp``.

When the library cannot be had (no compiler, no ninja, a failed compile) a warning naming the cause is issued
once per process and every op runs its pure-torch reference (``reference.py``): slower, same results.

Environment:

* ``DS_ASYNCHZP_OPS_CACHE``: cache root (default ``$XDG_CACHE_HOME/ds_asynchzp/ops``, else
  ``~/.cache/ds_asynchzp/ops``);
* ``DS_ASYNCHZP_OPS=reference``: never build or load, run the reference ops;
* ``CXX``: the C++ compiler (torch's rule, default ``c++``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

NAMESPACE = "ds_asynchzp"
CPU_SOURCES = ["registration.cpp", "cpu_layout.cpp", "cpu_quant.cpp", "cpu_zeropp.cpp"]
CUDA_SOURCES = ["cuda_layout.cu", "cuda_quant.cu", "cuda_ops.cpp"]
HEADERS = ["dtype_math.h", "quant_math.h", "cpu_kernels.h", "cpu_segments.h", "tensor_runs.h", "cuda_kernels.h",
           "cuda_vector.cuh", "cuda_tables.h"]
# -ffp-contract=off: no fused multiply-add, so the kernels round exactly as the reference does (quant_math.h).
# -march=native on x86-64: the library is built on the machine that runs it, and its loops need more than the
# x86-64 baseline (SSE2 has no unsigned max, no float-to-int8 packing) to vectorise: measured 5x on quantize.
# The cache key holds the CPU's feature flags, so nodes of another CPU sharing the cache build their own.
# -fopenmp: at::parallel_for splits work between torch's threads only in code compiled with OpenMP (ATen's
# header falls back to a serial loop without it); torch's libgomp pool is shared, so set_num_threads applies.
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
CFLAGS = ["-O3", "-ffp-contract=off", *_OPENMP] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64")
                                                   else [])
LDFLAGS = list(_OPENMP)
CUDA_CFLAGS = ["-O3", "--fmad=false"]

ENV_CACHE = "DS_ASYNCHZP_OPS_CACHE"
ENV_MODE = "DS_ASYNCHZP_OPS"


@dataclass(frozen=True)
class Status:
    """Which implementation the ops run for one device type, and why."""

    device: str             # "cpu" or "cuda"
    backend: str            # "compiled" or "reference"
    reason: str             # why this backend, in words
    build_dir: Optional[str] = None
    source_dir: Optional[str] = None

    @property
    def compiled(self) -> bool:
        return self.backend == "compiled"

    def __str__(self) -> str:
        return f"{self.backend} ({self.device}: {self.reason})"


def source_dir() -> Optional[Path]:
    """Where the sources are: the installed package's data first (a wheel), then the checkout's ``ops/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent.parent / "ops"):
        if all((candidate / name).is_file() for name in CPU_SOURCES):
            return candidate
    return None


def cache_root() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds_asynchzp" / "ops"


def _cpu_identity() -> str:
    """The CPU's feature flags (Linux), else its architecture: what -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _gpu_identity() -> str:
    """What nvcc compiles for: TORCH_CUDA_ARCH_LIST, else (torch's rule) the visible GPUs' compute capabilities."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    return ",".join(f"{major}.{minor}" for major, minor in
                    sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))


def _variant(with_cuda: bool) -> str:
    return f"cuda{torch.version.cuda}" if with_cuda else "cpu"


def build_key(src: Path, with_cuda: bool) -> str:
    """Hash of everything that makes one build differ from another."""
    digest = hashlib.sha256()
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else []) + HEADERS
    for name in names:
        path = src / name
        digest.update(name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
    extra = [torch.__version__, _variant(with_cuda), sys.implementation.cache_tag, _cpu_identity(),
             os.environ.get("CXX", "c++"), *CFLAGS, *(CUDA_CFLAGS if with_cuda else []),
             _gpu_identity() if with_cuda else ""]
    digest.update("\0".join(extra).encode())
    return digest.hexdigest()[:16]


def _build_dir_and_name(src: Path, with_cuda: bool):
    key = build_key(src, with_cuda)
    variant = _variant(with_cuda)
    name = f"ds_asynchzp_ops_{variant.replace('.', '_')}_{key}"
    return cache_root() / f"{variant}-torch{torch.__version__.replace('+', '_')}-{key}", name


def _compiler_problem() -> Optional[str]:
    """Why a build cannot even start, or None: the causes a user can fix, named before torch fails on them."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: {cxx!r} (from $CXX, default c++) is not on PATH; install g++ or set CXX"
    if not cpp_extension.is_ninja_available():
        return "ninja is not available (pip install ninja)"
    return None


def _first_error_line(exc: BaseException) -> str:
    """The compiler's first diagnostic in torch's build error, else its first line: what the warning names."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "error:" in line.lower():
            return line[:300]
    return (lines or [type(exc).__name__])[0][:300]


def _build_and_load(src: Path, with_cuda: bool) -> Path:
    """Load the cached library, building it first if this cache has none; returns its build directory."""
    build_dir, name = _build_dir_and_name(src, with_cuda)
    library = build_dir / f"{name}.so"
    marker = build_dir / "BUILT"
    # The marker is written after a complete build: another rank may still be linking `library`.
    if marker.is_file() and marker.read_text().strip() == name and library.is_file():
        torch.ops.load_library(str(library))
        return build_dir
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    kind = "cpu+cuda" if with_cuda else "cpu"
    print(f"building ds_asynchzp ops ({kind}) in {build_dir}, first use only ...", end=" ", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    try:
        sources = [str(src / s) for s in CPU_SOURCES + (CUDA_SOURCES if with_cuda else [])]
        cpp_extension.load(name=name, sources=sources, extra_cflags=CFLAGS, extra_cuda_cflags=CUDA_CFLAGS,
                           extra_ldflags=LDFLAGS,
                           extra_include_paths=[str(src)], build_directory=str(build_dir),
                           is_python_module=False, verbose=False)
    except BaseException:
        print("failed", file=sys.stderr, flush=True)
        raise
    print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    tmp = marker.with_name(f"BUILT.{os.getpid()}")
    tmp.write_text(name + "\n")
    os.replace(tmp, marker)
    return build_dir


class _Loader:
    """Process-wide state: one load attempt per process, one warning per failure."""

    def __init__(self):
        self.lock = threading.Lock()
        self.status: Dict[str, Status] = {}

    def get(self, device: str) -> Status:
        known = self.status.get(device)
        if known is not None:  # every op call asks: no lock once the answer is known
            return known
        with self.lock:
            if "cpu" not in self.status:
                self._load()
            if device == "cuda" and "cuda" not in self.status:
                self.status["cuda"] = Status("cuda", "reference", "CUDA is not available in this process")
            return self.status.get(device) or Status(device, "reference", f"no kernels for device type {device!r}")

    def _load(self) -> None:
        cuda = torch.cuda.is_available()
        devices = ["cpu"] + (["cuda"] if cuda else [])
        mode = os.environ.get(ENV_MODE, "").strip().lower()
        if mode == "reference":
            for dev in devices:
                self.status[dev] = Status(dev, "reference", f"{ENV_MODE}=reference")
            return
        src = source_dir()
        if src is None:
            self._fail(devices, "the C++ sources are missing (neither ds_asynchzp/ops/csrc nor a checkout's ops/)")
            return
        problem = _compiler_problem()
        if problem is not None:
            self._fail(devices, problem, src)
            return
        attempts = [True, False] if cuda else [False]
        for with_cuda in attempts:
            try:
                build_dir = _build_and_load(src, with_cuda)
            except Exception as exc:  # a failed compile or load: the reference takes over
                built = "cpu+cuda" if with_cuda else "cpu"
                self._warn(f"building the {built} ops failed: {_first_error_line(exc)}")
                if with_cuda:
                    continue  # the CPU kernels alone may still build
                self._fail(devices, f"building the ops failed: {_first_error_line(exc)}", src, warn=False)
                return
            reason = f"built from {src}" if with_cuda or not cuda else \
                f"built from {src}; the CUDA kernels failed to build"
            self.status["cpu"] = Status("cpu", "compiled", reason, str(build_dir), str(src))
            if cuda:
                self.status["cuda"] = (Status("cuda", "compiled", reason, str(build_dir), str(src)) if with_cuda
                                       else Status("cuda", "reference", "the CUDA kernels failed to build",
                                                   str(build_dir), str(src)))
            return

    def _fail(self, devices: List[str], reason: str, src: Optional[Path] = None, warn: bool = True) -> None:
        if warn:
            self._warn(reason)
        for dev in devices:
            self.status[dev] = Status(dev, "reference", reason, None, str(src) if src else None)

    @staticmethod
    def _warn(reason: str) -> None:
        warnings.warn(f"ds_asynchzp ops: {reason}; using the pure-torch reference ops instead (same results, "
                      "slower)", RuntimeWarning, stacklevel=5)


_LOADER = _Loader()


def status(device: str = "cpu") -> Status:
    """The ops' backend for `device` ("cpu" or "cuda") and why; builds or loads the library on first call."""
    return _LOADER.get(torch.device(device).type)


def compiled(device_type: str) -> bool:
    return _LOADER.get(device_type).compiled
