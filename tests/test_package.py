"""The package's shape: no import cycle between its modules and no import up its layers (deferred imports
included), the architecture's drawing and its list of direct deepspeed.comm callers true, the tooling starts
without DeepSpeed, and a pipeline model is refused before DeepSpeed starts anything."""

import ast
import re
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


def import_graph(deferred: bool = True) -> dict:
    """Module -> the package modules it imports (deferred imports, inside functions, included by default)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path, name, modules, deferred) if m in modules and m != name}
            for name, path in modules.items()}


def find_cycle(graph: dict) -> list:
    """One import circle of `graph` as a list of modules (first == last), or []."""
    state, stack = {}, []

    def visit(node):
        state[node] = "active"
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "active":
                return stack[stack.index(child):] + [child]
            if child not in state:
                found = visit(child)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return []

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return []


# The package's layers, lowest first (docs/ARCHITECTURE.md draws them). A module may import its own layer and
# the ones below it, never one above, deferred imports included. Definitions (pure: no DeepSpeed, no torch) at
# the bottom, then the compiled ops, the runtime's layers (platform, state, comm, scheduler, runtime), the public
# face (the package's __init__), the tooling, and on top the commands (every `cli` and `__main__` module).
LAYERS = [
    ("definitions", ("errors", "layout", "quantization", "formulas", "config_compat", "resolved_layout", "config",
                     "schema")),
    ("ops", ("ops",)),
    ("platform", ("platform",)),
    ("state", ("state",)),
    ("comm", ("comm",)),
    ("scheduler", ("scheduler",)),
    ("runtime", ("runtime",)),
    ("public face", ("",)),
    ("netem", ("netem",)),
    ("planner", ("planner",)),
    ("models", ("models",)),
    ("measure", ("measure",)),
    ("bench", ("bench",)),
    ("gpu_check", ("gpu_check",)),
]
COMMANDS = ("cli", "__main__")


def layer_of(module: str) -> int:
    """The index of `module`'s layer; the commands are above every other."""
    parts = module.split(".")
    if parts[-1] in COMMANDS:
        return len(LAYERS)
    first = parts[1] if len(parts) > 1 else ""
    for index, (_, members) in enumerate(LAYERS):
        if first in members:
            return index
    raise AssertionError(f"{module} belongs to no layer: add its package or module to LAYERS in this test and to "
                         "the drawing in docs/ARCHITECTURE.md")


def upward_imports(graph: dict) -> list:
    return sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_its_own_layer_or_below():
    wrong = upward_imports(import_graph())
    assert not wrong, "imports that point up the layers: " + "; ".join(wrong)


def test_the_layer_checks_catch_a_planted_upward_import_and_a_planted_circle():
    graph = import_graph()

    def planted(*edges) -> dict:
        copy = {name: set(targets) for name, targets in graph.items()}
        for source, target in edges:
            copy[source].add(target)
        return copy

    # A deferred import of a tool from the runtime (what initialize once did for asynchzp-ab's key).
    upward = planted(("ds_asynchzp.runtime.api", "ds_asynchzp.measure.recording"))
    assert set(upward_imports(upward)) - set(upward_imports(graph)) == {
        "ds_asynchzp.runtime.api imports ds_asynchzp.measure.recording"}
    # Circles, checked on the runtime's modules (the layer test above keeps them free of any): one through two
    # layers, the state importing the communication flow that imports it; one inside a package, deferred.
    runtime_layers = {i for i, (layer, _) in enumerate(LAYERS) if layer in ("platform", "state", "comm", "scheduler",
                                                                             "runtime")}
    runtime = {name for name in graph if layer_of(name) in runtime_layers}
    assert "ds_asynchzp.platform.process_groups" in runtime and "ds_asynchzp.comm.grad_reduce" in runtime

    def runtime_only(full: dict) -> dict:
        return {name: targets & runtime for name, targets in full.items() if name in runtime}

    assert find_cycle(runtime_only(graph)) == []
    two_layers = planted(("ds_asynchzp.state.grad_shards", "ds_asynchzp.comm.grad_reduce"),
                         ("ds_asynchzp.comm.grad_reduce", "ds_asynchzp.state.grad_shards"))
    assert find_cycle(runtime_only(two_layers))
    assert "ds_asynchzp.platform.deepspeed_internals" in graph["ds_asynchzp.platform.process_groups"]
    one_package = planted(("ds_asynchzp.platform.deepspeed_internals", "ds_asynchzp.platform.process_groups"))
    assert find_cycle(runtime_only(one_package))


def test_the_architecture_draws_every_layer_in_order():
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    start = text.index("```text") + len("```text")
    drawing = text[start: text.index("```", start)].strip().splitlines()
    # Each line names its layer in its first column (text before two spaces); the separator line is not a layer.
    drawn = [line.split("  ")[0].strip() for line in drawing if not line.startswith("- ")]
    assert drawn == ["commands"] + [name for name, _ in reversed(LAYERS)], drawn


# What a module may use of deepspeed.comm / torch.distributed without being a caller of it: questions about the
# world, not communication.
COMM_QUERIES = {"get_rank", "get_world_size", "is_initialized", "get_world_group", "ReduceOp", "get_local_rank",
                "get_global_rank", "get_backend", "is_available", "get_process_group_ranks", "GroupMember",
                "ProcessGroup", "distributed_c10d"}
# DeepSpeed's backend object (`comm_backend()`) is deepspeed.comm too; `comm/collectives.py` is where the package's own
# collectives call it, by design, and is named apart in the paragraph.
COMM_NAMES = ("ds_comm", "dist", "torch.distributed", "deepspeed.comm", "comm_backend()")
COLLECTIVES = "comm/collectives.py"
CALLERS_HEADING = "**Who calls `deepspeed.comm` directly.**"
CALLERS_LIST = "(a test keeps this list exact):"


def direct_comm_callers(package: Path = PACKAGE) -> dict:
    """Package-relative path -> the deepspeed.comm / torch.distributed operations the module names."""
    out = {}
    for path in package.rglob("*.py"):
        if path.relative_to(package).as_posix() == COLLECTIVES:
            continue
        used = {node.attr for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and ast.unparse(node.value) in COMM_NAMES
                and node.attr not in COMM_QUERIES}
        if used:
            out[path.relative_to(package).as_posix()] = sorted(used)
    return out


def documented_comm_callers() -> set:
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    paragraph = " ".join(text[text.index(CALLERS_HEADING):].split("\n\n")[0].split())
    paragraph = paragraph[paragraph.index(CALLERS_LIST):]
    return set(re.findall(r"`([\w/]+\.py)`", paragraph))


def test_the_modules_that_call_deepspeed_comm_are_the_documented_ones(tmp_path):
    found = direct_comm_callers()
    assert set(found) == documented_comm_callers(), (
        f"docs/ARCHITECTURE.md's paragraph {CALLERS_HEADING} must list exactly the modules that call "
        f"deepspeed.comm / torch.distributed directly: {found}")
    # Planted: a state module that starts a collective of its own is found.
    planted = tmp_path / "ds_asynchzp"
    (planted / "state").mkdir(parents=True)
    (planted / "state" / "x.py").write_text("def f(t, ds_comm):\n    ds_comm.all_reduce(t)\n    ds_comm.get_rank()\n")
    assert direct_comm_callers(planted) == {"state/x.py": ["all_reduce"]}


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
