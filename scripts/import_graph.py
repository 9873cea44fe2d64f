"""Print the import graph of `rllm_async`, between layers or between modules, as text, Mermaid or DOT.

Every import counts: module-level, inside functions and under `TYPE_CHECKING`. Only imports of
`rllm_async` itself are edges. Layers are the package's top-level modules and subpackages, with
each backend of `rllm_async.backends`, each engine of `rllm_async.engines` and each module of the
planner (`rllm_async.plan`, whose recorder lies below the trainer and the rest above it) a layer
of its own.

    python scripts/import_graph.py                # layer -> layers it imports
    python scripts/import_graph.py --mermaid      # the same as a Mermaid flowchart (docs)
    python scripts/import_graph.py --dot --modules
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "rllm_async"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
SPLIT = (f"{PACKAGE}.backends", f"{PACKAGE}.engines", f"{PACKAGE}.plan")  # children are layers

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name of the module at `path` (a package is named by its `__init__.py`)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path = ROOT) -> Graph:
    """Each module of the package -> the package's modules it imports."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: Graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = {t for t in _imported(tree, package, paths) if t != name}
    return graph


def _imported(tree: ast.AST, package: str, modules: Mapping[str, Path]) -> Iterable[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import pkg.mod.attr` -> the module
                target = target.rpartition(".")[0]
            if target:
                yield target


def layer(module: str) -> str:
    """The layer of a module: its top-level module or subpackage, or its backend, engine or
    planner module."""
    for split in SPLIT:
        if module.startswith(split + "."):
            return ".".join(module.split(".")[: split.count(".") + 2])
    return ".".join(module.split(".")[:2])


def layer_graph(graph: Mapping[str, set[str]]) -> Graph:
    """The module graph collapsed onto layers, without self-edges."""
    out: Graph = {}
    for src, targets in graph.items():
        edges = out.setdefault(layer(src), set())
        edges.update(t for t in map(layer, targets) if t != layer(src))
    return out


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".") if name != PACKAGE else PACKAGE


def render(graph: Mapping[str, set[str]], fmt: str) -> str:
    """`graph` as plain text (one line per node), a Mermaid flowchart or a DOT digraph."""
    edges = sorted((_short(s), _short(t)) for s, ts in graph.items() for t in ts)
    if fmt == "mermaid":
        ids = {
            n: f"n{i}"
            for i, n in enumerate(sorted({_short(n) for n in graph} | {t for _, t in edges}))
        }
        lines = ["flowchart TD", *(f'    {ids[n]}["{n}"]' for n in ids)]
        return "\n".join([*lines, *(f"    {ids[s]} --> {ids[t]}" for s, t in edges)])
    if fmt == "dot":
        body = [f'    "{s}" -> "{t}";' for s, t in edges]
        return "\n".join(["digraph rllm_async {", "    rankdir=TB;", *body, "}"])
    return "\n".join(
        f"{_short(n)} -> {', '.join(sorted(map(_short, graph[n]))) or '-'}" for n in sorted(graph)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    style = parser.add_mutually_exclusive_group()
    style.add_argument("--mermaid", action="store_true", help="a Mermaid flowchart")
    style.add_argument("--dot", action="store_true", help="a Graphviz DOT digraph")
    parser.add_argument("--modules", action="store_true", help="modules, not layers")
    args = parser.parse_args()
    graph = module_graph()
    shown = graph if args.modules else layer_graph(graph)
    print(render(shown, "mermaid" if args.mermaid else "dot" if args.dot else "text"))
    for cycle in cycles(graph):
        print(f"# import cycle: {' -> '.join(cycle)}")


if __name__ == "__main__":
    main()
