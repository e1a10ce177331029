"""The package's shape: no import cycle between its modules, the tooling starts without DeepSpeed, and a
pipeline model is refused before DeepSpeed starts anything."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ds_asynchzp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules=(), deferred: bool = False) -> set:
    """Package modules imported at module level (imports inside functions are deferred and cannot cycle), or
    anywhere in the file with `deferred`."""
    is_package = path.name == "__init__.py"
    out = set()
    tree = ast.parse(path.read_text())
    for node in (ast.walk(tree) if deferred else tree.body):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("ds_asynchzp"):
                submodules = {f"{target}.{alias.name}" for alias in node.names} & set(modules)
                # `from package import submodule` needs only the submodule (the package is already importing).
                out.update(submodules or {target})
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("ds_asynchzp"))
    return out


def test_no_import_cycle_between_modules():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in _imports(path, name, modules) if m in modules and m != name} for name, path in modules.items()}
    # A package's __init__ that only re-exports its own submodules is not a cycle with them.
    state, stack = {}, []

    def visit(node):
        state[node] = "active"
        stack.append(node)
        for child in graph[node]:
            if state.get(child) == "active":
                cycle = stack[stack.index(child):] + [child]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if child not in state:
                visit(child)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


# The runtime's layers, lowest first: each may import the ones below it, never one above (deferred imports
# included). The runtime uses the scheduler and the communication flows, which use the state, which uses the
# platform (DeepSpeed's private surface, process groups, streams).
LAYERS = ["platform", "state", "comm", "scheduler", "runtime"]


def test_runtime_layers_import_downwards_only():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    wrong = []
    for name, path in modules.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in LAYERS:
            continue
        level = LAYERS.index(parts[1])
        for target in _imports(path, name, modules, deferred=True):
            tparts = target.split(".")
            if len(tparts) > 1 and tparts[1] in LAYERS and LAYERS.index(tparts[1]) > level:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports that point up the layers: " + "; ".join(sorted(wrong))


@pytest.mark.parametrize("module", ["ds_asynchzp.planner.cli", "ds_asynchzp.netem.cleanup", "ds_asynchzp.config",
                                    "ds_asynchzp.errors", "ds_asynchzp"])
def test_tooling_and_config_start_without_deepspeed(module):
    code = f"import sys, {module}; assert 'deepspeed' not in sys.modules, sorted(m for m in sys.modules if 'deepspeed' in m)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_pipeline_model_is_refused_before_deepspeed_starts():
    import torch
    from deepspeed.pipe import PipelineModule

    import ds_asynchzp
    from ds_asynchzp.errors import AsyncHZPConfigError

    class Pipeline(PipelineModule):
        def __init__(self):  # no process groups: the check must come before DeepSpeed needs them
            torch.nn.Module.__init__(self)

    config = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "async_hzp": {"node_size": 1}}
    with pytest.raises(AsyncHZPConfigError, match="PipelineModule"):
        ds_asynchzp.resolve_for_initialize(model=Pipeline(), config=config)
