"""The package's layering (../shared/DESIGN.md, "Dependency direction"), checked on its import graph."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository


def _load_script() -> ModuleType:
    path = ROOT / "scripts" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ig = _load_script()
GRAPH: dict[str, set[str]] = ig.module_graph()
CONCRETE = ("backends.local", "backends.tinker", "backends.verl", "backends.sim", "engines")
# Core -> concrete imports that remain, each with its reason:
KNOWN_CORE_TO_CONCRETE = {
    # `rllm-async simulate` compares async with sync runs on the sim backend itself.
    ("rllm_async.plan.simulate", "rllm_async.backends.sim"),
    # `rllm-async plan` replays a recorded run's workload on the sim backend.
    ("rllm_async.plan.replay", "rllm_async.backends.sim"),
}


def _in(module: str, *prefixes: str) -> bool:
    return any(
        module == f"rllm_async.{p}" or module.startswith(f"rllm_async.{p}.") for p in prefixes
    )


def _imports_of(*prefixes: str) -> set[tuple[str, str]]:
    return {(s, t) for s, targets in GRAPH.items() if _in(s, *prefixes) for t in targets}


def _diagram() -> tuple[list[list[str]], list[str], str]:
    """The layers docs/architecture.md draws: the core's lines from the top, the concrete parts,
    and the highest of the core's lines that the concrete parts may import."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split("## Layers", 1)[1].split("```", 2)[1]
    # Each line: its layers, then (after two spaces or more) what they are.
    lines = [re.split(r"\s{2,}", line.strip())[0] for line in block.strip().split("\n")]
    split = next(i for i, line in enumerate(lines) if line.startswith("concrete: "))
    core = [line.removeprefix("-> ").split(", ") for line in lines[:split]]
    concrete = lines[split].removeprefix("concrete: ").split(", ")
    return core, concrete, lines[split + 1].removeprefix("-> ").split()[0]


CORE_LINES, CONCRETE_LAYERS, CONCRETE_IMPORT_FROM = _diagram()
LAYERS = {
    ig._short(src): {ig._short(t) for t in targets}
    for src, targets in ig.layer_graph(GRAPH).items()
}


def _line(layer: str) -> int:
    return next(i for i, line in enumerate(CORE_LINES) if layer in line)


def test_the_architecture_diagram_places_every_layer_once() -> None:
    drawn = [layer for line in CORE_LINES for layer in line] + CONCRETE_LAYERS
    assert len(drawn) == len(set(drawn)), "a layer drawn twice"
    assert set(drawn) == set(LAYERS), "the diagram names every layer, and only those"


def test_no_layer_imports_a_layer_above_it() -> None:
    """Each core layer imports only its line and those below; a concrete part, other concrete
    parts and the core's lines from `rollout` down (the core importing a concrete part is the
    test below's)."""
    floor = _line(CONCRETE_IMPORT_FROM)
    upward = {
        (src, dst)
        for src, targets in LAYERS.items()
        for dst in targets
        if dst not in CONCRETE_LAYERS
        and _line(dst) < (floor if src in CONCRETE_LAYERS else _line(src))
    }
    assert upward == set()


def test_the_graph_sees_the_package() -> None:
    assert "rllm_async.rollout" in GRAPH["rllm_async.workflows.base"]
    assert "rllm_async.backends.sim.backend" in GRAPH["rllm_async.backends.sim"]
    assert len(GRAPH) > 50


def test_no_import_cycles_between_modules() -> None:
    assert ig.cycles(GRAPH) == []


def test_the_core_never_imports_a_concrete_backend() -> None:
    core = {(s, t) for s, targets in GRAPH.items() if not _in(s, *CONCRETE) for t in targets}
    assert {(s, t) for s, t in core if _in(t, *CONCRETE)} == KNOWN_CORE_TO_CONCRETE


def _reached_from(module: str) -> set[str]:
    """Every module that importing `module` can import, directly or not (any import counts, and
    importing a module runs its packages' `__init__` first)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parents = {name.rsplit(".", i)[0] for i in range(1, name.count("."))}
        for target in (GRAPH[name] | parents) - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_trainer_reaches_the_planner_only_through_its_recorder() -> None:
    """The trainer records its workload with `plan.record`; the fit, the replay and the
    simulator, which drive the trainer, are never imported with it."""
    planner = {m for m in GRAPH if _in(m, "plan")}
    assert {"rllm_async.plan.record", "rllm_async.plan.fit", "rllm_async.plan.replay"} <= planner
    reached = _reached_from("rllm_async.trainer") & planner
    assert reached == {"rllm_async.plan", "rllm_async.plan.record"}
    assert GRAPH["rllm_async.plan"] == set(), "the planner's __init__ imports nothing"


def test_rollout_never_imports_workflows_or_gateway_only_what_lies_below() -> None:
    below = ("rollout", "grammar", "protocols", "types", "config")
    assert {(s, t) for s, t in _imports_of("rollout") if not _in(t, *below)} == set()


def test_gateway_and_backends_never_import_workflows() -> None:
    assert {(s, t) for s, t in _imports_of("gateway", "backends") if _in(t, "workflows")} == set()


def test_the_engines_never_import_a_backend() -> None:
    """The backends import the engines (the vLLM engine is shared by the local and verl
    learners); what the engines share with the backends lies below both, in `protocols`."""
    assert {(s, t) for s, t in _imports_of("engines") if _in(t, "backends")} == set()


def test_the_gateway_imports_only_the_rollout_layer_and_below() -> None:
    below = ("gateway", "rollout", "grammar", "protocols", "types", "config")
    assert {(s, t) for s, t in _imports_of("gateway") if not _in(t, *below)} == set()


@pytest.mark.parametrize("fmt", ["text", "mermaid", "dot"])
def test_the_graph_renders(fmt: str) -> None:
    out = ig.render(ig.layer_graph(GRAPH), fmt)
    assert "rollout" in out and "workflows" in out
    assert out.startswith({"text": "", "mermaid": "flowchart TD", "dot": "digraph"}[fmt])
