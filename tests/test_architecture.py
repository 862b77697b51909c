"""The package's layering: no import loops, a pure simulator, libraries below the jobs."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from interlace.comm.forward_plan import Overlap
from interlace.comm.plan import Bucketing
from interlace.kfac.enums import ComputeMethod, FactorCommChoice, PlacementChoice
from interlace.pipeline.schedule import SCHEDULE_TYPES

SRC = Path(__file__).resolve().parents[1] / "src" / "interlace"
LIBRARIES = (
    "interlace.comm",
    "interlace.kfac",
    "interlace.pipeline",
    "interlace.dp",
    "interlace.emulate",
)
JOBS = ("interlace.train", "interlace.bench", "interlace.cli")
MAX_LINES = 900


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def _imported(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The interlace modules ``name`` imports, wherever in the file the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        for target in targets:
            # ``from a.b import c`` names a.b.c, a function or a module: the deepest known wins.
            module = target
            while module and module not in known:
                module = module.rpartition(".")[0]
            if module and module != name:
                yield module


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: set(_imported(name, path, known)) for name, path in modules.items()}


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among modules, ignoring a package's imports of its own submodules."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if target.startswith(node + "."):
                continue  # a package re-exporting its own submodules is no loop
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_reader_finds_a_planted_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": {"q"}, "q": set()}) is None


def test_no_import_loops() -> None:
    assert _cycle(_graph()) is None


def test_the_simulator_is_pure() -> None:
    forbidden = ("interlace.bench", "interlace.profile", "interlace.train", "interlace.launch")
    for name, targets in _graph().items():
        if _within(name, ("interlace.sim",)):
            assert not [t for t in targets if _within(t, forbidden)], name
    for path in (SRC / "sim").rglob("*.py"):
        text = path.read_text()
        assert "torch.distributed" not in text and "import distributed" not in text, path


@pytest.mark.parametrize("library", LIBRARIES)
def test_libraries_never_import_the_jobs(library: str) -> None:
    for name, targets in _graph().items():
        if _within(name, (library,)):
            assert not [t for t in targets if _within(t, JOBS)], name


def test_no_source_file_is_a_big_room() -> None:
    sizes = {
        str(path.relative_to(SRC)): len(path.read_text().splitlines()) for path in SRC.rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


#: Each policy the runtime executes, by the module that defines its objects: the simulator must
#: price these very objects (imported), never a rule of its own for them.
POLICY_MODULES = {
    "a bucketing plan": "interlace.comm.plan",
    "a bucketing's price on channels": "interlace.comm.pricing",
    "the forward overlap": "interlace.comm.forward_plan",
    "a K-FAC placement": "interlace.kfac.placements",
    "a decomposition method": "interlace.kfac.methods",
    "a factor-communication mode": "interlace.kfac.factor_modes",
    "a pipeline schedule": "interlace.pipeline.schedule",
}


def _policy_names() -> set[str]:
    """Every name a policy is chosen by: the members of the runtime's choice enums."""
    enums = (Bucketing, Overlap, ComputeMethod, FactorCommChoice, PlacementChoice)
    return {str(member.value) for enum in enums for member in enum} | set(SCHEDULE_TYPES)


def test_the_simulator_prices_the_runtimes_policy_objects() -> None:
    imported = set().union(
        *(targets for name, targets in _graph().items() if _within(name, ("interlace.sim",)))
    )
    missing = {policy: name for policy, name in POLICY_MODULES.items() if name not in imported}
    assert missing == {}, f"the simulator does not import the runtime's objects for {missing}"


def test_the_simulator_defines_no_policy_class_of_its_own() -> None:
    modules = _modules()
    runtime_classes = {
        node.name
        for module in POLICY_MODULES.values()
        for node in ast.walk(ast.parse(modules[module].read_text()))
        if isinstance(node, ast.ClassDef)
    }
    redefined = {
        f"{path.name}: {node.name}"
        for path in (SRC / "sim").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name in runtime_classes
    }
    assert redefined == set()


def test_the_simulator_chooses_nothing_by_a_policys_name() -> None:
    names = _policy_names()
    compared = set()
    for path in (SRC / "sim").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for operand in (node.left, *node.comparators):
                    if isinstance(operand, ast.Constant) and operand.value in names:
                        compared.add(f"{path.name}:{node.lineno} {operand.value!r}")
    assert compared == set()
