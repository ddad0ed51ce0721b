"""The packages and top-level modules of megatron/ import each other without a cycle, so each can
be read (and tested) knowing only what lies below it. The graph is read from the source's import
statements, type-only imports included: a new cycle fails here with the files that make it."""

import ast
from collections import defaultdict
from pathlib import Path

MEGATRON = Path(__file__).resolve().parent.parent / "megatron"
# node -> imported node -> the files whose imports make that edge
Graph = dict[str, dict[str, set[str]]]


def node_of(module: str) -> str:
    """megatron.runtime.zero.stages -> runtime; megatron.training.loop -> training."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megatron"


def imported_modules(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("megatron"):
            module = node.module or ""
            # `from megatron import training` names the module in the alias
            found += [f"megatron.{alias.name}" for alias in node.names] if module == "megatron" else [module]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("megatron")]
    return found


def import_graph(root: Path) -> Graph:
    graph: Graph = defaultdict(lambda: defaultdict(set))
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        source = node_of(".".join(part for part in parts if part != "__init__"))
        for module in imported_modules(ast.parse(path.read_text())):
            if (target := node_of(module)) not in (source, "megatron"):
                graph[source][target].add(str(path.relative_to(root.parent)))
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                found.append(sorted([*component, node]))

    for node in sorted(set(graph) | {t for targets in graph.values() for t in targets}):
        if node not in index:
            visit(node)
    return found


def describe(graph: Graph, component: list[str]) -> str:
    edges = [
        f"  {source} -> {target}: {', '.join(sorted(files))}"
        for source in component
        for target, files in sorted(graph.get(source, {}).items())
        if target in component
    ]
    return f"cycle among {', '.join(component)}:\n" + "\n".join(edges)


def test_the_packages_import_each_other_without_a_cycle() -> None:
    graph = import_graph(MEGATRON)
    assert {"runtime", "checkpoint", "config", "model", "data", "hf", "cli"} <= set(graph) | {
        t for targets in graph.values() for t in targets
    }
    assert not (found := cycles(graph)), "\n".join(describe(graph, component) for component in found)


def test_the_check_finds_a_cycle_through_a_type_only_import(tmp_path: Path) -> None:
    root = tmp_path / "megatron"
    for package, source in {
        "runtime": "from megatron.checkpoint.save import write\n",
        "checkpoint": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron.runtime.engine import E\n",
        "model": "import megatron.ops.io\n",
        "ops": "",
    }.items():
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / "code.py").write_text(source)
    graph = import_graph(root)
    assert cycles(graph) == [["checkpoint", "runtime"]]
    assert describe(graph, ["checkpoint", "runtime"]) == (
        "cycle among checkpoint, runtime:\n"
        "  checkpoint -> runtime: megatron/checkpoint/code.py\n"
        "  runtime -> checkpoint: megatron/runtime/code.py"
    )


def test_every_main_is_a_command_line_entry_behind_run_entry_point() -> None:
    """A tool's main() lives in megatron/cli/ and ends through run_entry_point, so its errors are one sentence."""
    misplaced, bare = [], []
    for path in sorted(MEGATRON.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                calls = {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
                if path.parent.name != "cli":
                    misplaced.append(str(path.relative_to(MEGATRON.parent)))
                elif "run_entry_point" not in calls:
                    bare.append(str(path.relative_to(MEGATRON.parent)))
    assert misplaced == [] and bare == []


def test_the_runtime_knows_parameters_by_their_placement_not_by_the_model() -> None:
    """The runtime reads where a parameter lives from megatron/placement.py (issue 29 point 5)."""
    graph = import_graph(MEGATRON)
    assert "model" not in graph["runtime"], dict(graph["runtime"]["model"])
    assert "placement" in graph["runtime"] and "placement" in graph["model"]
