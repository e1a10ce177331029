"""The ops' builder: a wheel ships the sources and builds from an installed copy, the cache is keyed and reused,
and a missing compiler or a failed build falls back to the reference with one warning naming the cause.

Each case runs in a fresh interpreter with a fresh cache directory: the builder loads once per process.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ds_asynchzp.ops import builder

REPO = Path(__file__).resolve().parent.parent
SOURCES = builder.CPU_SOURCES + builder.CUDA_SOURCES + builder.HEADERS

# Run in every child: the ops work (compiled or not) and agree with the reference.
CHECK_OPS = """
import torch
from ds_asynchzp import ops
from ds_asynchzp.ops import reference
x = torch.randn(1001)
q, s = ops.quantize(x, 8, 64)
q_ref, s_ref = torch.empty_like(q), torch.empty_like(s)
reference.quantize(x, q_ref, s_ref, 8, 64)
assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
buf = torch.randn(3, 50)
assert torch.equal(ops.pack([buf[:, :7], buf[:, 7:]]), torch.cat([buf[:, :7].reshape(-1), buf[:, 7:].reshape(-1)]))
"""


def run_python(code: str, cwd: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in (builder.ENV_CACHE, builder.ENV_MODE)}
    full_env.update(env)
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The project's wheel, built from a copy of its files (so the checkout stays untouched), and unpacked as
    pip would install it."""
    root = tmp_path_factory.mktemp("wheel")
    project = root / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    for name in ("ds_asynchzp", "ops"):
        shutil.copytree(REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(root / "dist"), str(project)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    path = next((root / "dist").glob("ds_asynchzp-*.whl"))
    site = root / "site"
    with zipfile.ZipFile(path) as archive:
        archive.extractall(site)
        names = set(archive.namelist())
    return names, site


def test_wheel_ships_the_sources_and_the_bench_script(wheel):
    names, site = wheel
    missing = [name for name in SOURCES if f"ds_asynchzp/ops/csrc/{name}" not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert not any(name.startswith("ops/") for name in names), "sources leaked to a top-level ops/ in site-packages"
    entry_points = next(site.glob("ds_asynchzp-*.dist-info")) / "entry_points.txt"
    assert "asynchzp-ops-bench = ds_asynchzp.ops.bench:main" in entry_points.read_text()


def test_installed_copy_builds_once_then_loads_from_cache(wheel, tmp_path):
    _, site = wheel
    cache = tmp_path / "cache"
    probe = CHECK_OPS + f"""
import ds_asynchzp.ops as package
status = ops.status()
print(status)
assert package.__file__.startswith({str(site)!r}), package.__file__
assert status.compiled, status
assert status.source_dir == {str(site / "ds_asynchzp" / "ops" / "csrc")!r}, status.source_dir
assert status.build_dir.startswith({str(cache)!r}), status.build_dir
"""
    # cwd outside the checkout, PYTHONPATH first: the unpacked wheel, not the checkout, is what imports.
    first = run_python(probe, cwd=tmp_path, PYTHONPATH=str(site), DS_ASYNCHZP_OPS_CACHE=str(cache))
    announce = re.findall(r"building ds_asynchzp ops \(cpu\) in (\S+), first use only \.\.\. done in [\d.]+ s",
                          first.stderr)
    assert announce and announce[0].startswith(str(cache)), first.stderr[-2000:]
    again = run_python(probe, cwd=tmp_path, PYTHONPATH=str(site), DS_ASYNCHZP_OPS_CACHE=str(cache))
    assert "building" not in again.stderr, again.stderr[-2000:]


def test_missing_compiler_falls_back_with_one_warning(tmp_path):
    cache = tmp_path / "cache"
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    code = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")   # so that only the builder's own once-only rule limits it
""" + "\n".join("    " + line for line in CHECK_OPS.strip().splitlines()) + """
    ops.quantize(x, 4, 64)
    status = ops.status()
ours = [str(w.message) for w in caught if "ds_asynchzp ops" in str(w.message)]
assert len(ours) == 1, ours
assert "no C++ compiler" in ours[0] and "/nonexistent/c++" in ours[0] and "reference" in ours[0], ours[0]
assert issubclass([w for w in caught if "ds_asynchzp ops" in str(w.message)][0].category, RuntimeWarning)
assert status.backend == "reference" and "no C++ compiler" in status.reason, status
print(status)
"""
    run_python(code, cwd=REPO, CXX="/nonexistent/c++", PATH=str(empty_bin), DS_ASYNCHZP_OPS_CACHE=str(cache))
    assert not cache.exists() or not any(cache.rglob("*.so")), "nothing may be built without a compiler"


def test_failed_build_falls_back_naming_the_compiler_error(tmp_path):
    # A checkout's layout (package beside ops/) whose sources do not compile: every one of them, so that the
    # first compile job fails whichever ninja starts first, and at once (a missing include is fatal at once).
    for name in ("ds_asynchzp", "ops"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in builder.CPU_SOURCES:
        source = tmp_path / "ops" / name
        source.write_text("#include <deliberately_broken_for_this_test.h>\n" + source.read_text())
    code = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
""" + "\n".join("    " + line for line in CHECK_OPS.strip().splitlines()) + """
    status = ops.status()
ours = [str(w.message) for w in caught if "ds_asynchzp ops" in str(w.message)]
assert len(ours) == 1, ours
assert "building the cpu ops failed" in ours[0] and "deliberately_broken_for_this_test.h" in ours[0], ours[0]
assert status.backend == "reference" and "deliberately_broken_for_this_test.h" in status.reason, status
"""
    # One compile job at a time: the first failure stops the build.
    done = run_python(code, cwd=tmp_path, DS_ASYNCHZP_OPS_CACHE=str(tmp_path / "cache"), MAX_JOBS="1",
                      PYTHONPATH=str(tmp_path))
    assert "first use only ... failed" in done.stderr


def test_reference_can_be_forced_without_a_warning(tmp_path):
    code = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
""" + "\n".join("    " + line for line in CHECK_OPS.strip().splitlines()) + """
    status = ops.status()
assert not [w for w in caught if "ds_asynchzp ops" in str(w.message)]
assert status.backend == "reference" and "DS_ASYNCHZP_OPS=reference" in status.reason, status
"""
    run_python(code, cwd=REPO, DS_ASYNCHZP_OPS="reference", DS_ASYNCHZP_OPS_CACHE=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_cache_key_follows_sources_and_device(tmp_path, monkeypatch):
    shutil.copytree(REPO / "ops", tmp_path / "ops")
    src = tmp_path / "ops"
    cpu, cuda = builder.build_key(src, False), builder.build_key(src, True)
    assert cpu != cuda and len(cpu) == 16
    header = src / "quant_math.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert builder.build_key(src, False) != cpu
    monkeypatch.setenv(builder.ENV_CACHE, str(tmp_path / "elsewhere"))
    assert builder.cache_root() == tmp_path / "elsewhere"
