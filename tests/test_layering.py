"""The package's layers: every import of every ``harmony_fx`` module points down (or sideways within
its layer), and no modules import each other in a circle.

Read from the source with ``ast``: every ``import`` and ``from ... import``, those inside functions
and under ``TYPE_CHECKING`` too (a lazy import is still an arrow). A lower layer never imports a
higher one: the planner is handed the runtime's measured figures (``calibrate``), it never calls
the compiler; the runtime's NVMe store and the planner read the tier's policy from a floor module
both use (``tier_policy``); no product module imports ``harmony_fx.testing``.
"""
from __future__ import annotations

import ast
import pathlib

import harmony_fx

PACKAGE = pathlib.Path(harmony_fx.__file__).parent

# Lowest first. A name is a top-level module or subpackage of harmony_fx ("__init__": the package's
# own); a module may import its own layer's and any lower layer's modules, never a higher layer's.
LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: options, trace files, the tier's policy, models, where a warning points
    ("config", "trace", "tier_policy", "models", "user_frames"),
    ("ir",),
    ("analysis",),
    ("program",),
    ("passes",),
    ("lowering",),
    ("runtime",),
    ("frontend",),       # keys calls on the runtime's ambient state (runtime.ambient)
    ("planner",),
    ("compiler",),       # runs the frontend, the planner's choice, the lowering; probes on the runtime
    ("calibrate", "pictures"),
    ("api", "backend"),
    ("distributed",),
    ("training",),
    ("trainer",),
    ("__init__",),       # the public names (harmony_fx.compile, Trainer, ...)
    ("integrations", "commands", "cli"),  # built on the public names
    ("testing",),        # tests' models and helpers: no product module imports them
)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, pathlib.Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str) -> set[str]:
    """The harmony_fx modules ``module`` imports (a ``from package import name`` of a submodule
    is that submodule; of anything else, the package)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH: dict[str, set[str]] = {module: _imports(module) for module in MODULES}


def _layer_name(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> int:
    name = _layer_name(module)
    return next(index for index, layer in enumerate(LAYERS) if name in layer)


def test_every_module_has_a_layer() -> None:
    named = {name for layer in LAYERS for name in layer}
    assert len(named) == sum(map(len, LAYERS)), "a name is in two layers"
    missing = sorted({_layer_name(module) for module in MODULES} - named)
    assert not missing, f"put {missing} into one of LAYERS (tests/test_layering.py)"
    gone = sorted(named - {_layer_name(module) for module in MODULES})
    assert not gone, f"LAYERS names {gone}, which harmony_fx does not have"


def test_no_module_imports_a_higher_layer() -> None:
    upward = [f"{module} -> {target} ({_layer_name(module)} is below {_layer_name(target)})"
              for module, targets in sorted(GRAPH.items()) for target in sorted(targets)
              if _layer(target) > _layer(module)]
    assert not upward, f"{len(upward)} import(s) point up the layers:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_what_they_check() -> None:
    """The walk finds lazy imports inside functions and the checks catch what they are for."""
    assert "harmony_fx.planner.chain" in GRAPH["harmony_fx.compiler.driver"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("harmony_fx.runtime.tier") < _layer("harmony_fx.compiler.driver") < _layer("harmony_fx.api")
