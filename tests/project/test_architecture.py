"""The layout a newcomer reads: imports go one way, no module holds more than one reader can,
and the node's scripts are listed by the stage they serve."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("clusterspec", "node_render", "cluster_constructs", "cluster_ops", "stacks")
MAX_LINES = 600
MARGIN = 50


def modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name (a package by its own name)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its text: at the top, inside functions, and
    under TYPE_CHECKING (a cycle hidden there is still a cycle of the design)."""

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                return ".".join(parts[:i])
        return None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            found = resolve(t)
            if found and found != name:
                out.add(found)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_hidden_under_type_checking(tmp_path: Path) -> None:
    """The check itself can fail: two modules that import each other, one only for typing."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import A\n")
    known = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {n: imports(n, p, known) for n, p in known.items()}
    assert cycles(graph) == [["a", "b"]]


def test_no_module_imports_one_that_imports_it_back() -> None:
    known = modules()
    assert len(known) > 40, "the walk found the project's modules"
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_no_module_imports_the_cli_entry_point() -> None:
    known = modules()
    importers = sorted(name for name, path in known.items() if "cluster_ops.cli" in imports(name, path, known))
    assert importers == []


def test_render_decides_what_a_node_runs_and_userdata_only_packages_it() -> None:
    known = modules()
    assert "node_render.node_files" in imports("node_render.userdata", known["node_render.userdata"], known)
    for renderer in ("node_render.render", "node_render.node_files", "node_render.proxies"):
        assert "node_render.userdata" not in imports(renderer, known[renderer], known), renderer


def test_the_spec_imports_nothing_of_the_renderer_and_the_renderer_nothing_of_the_stack() -> None:
    """The flow is spec -> node files -> constructs and commands: no arrow back up."""
    known = modules()
    later = {"clusterspec": {"node_render", "cluster_constructs", "cluster_ops", "stacks"}, "node_render": {"cluster_constructs", "cluster_ops", "stacks"}}
    upward = {name: sorted(i for i in imports(name, path, known) if i.split(".")[0] in later.get(name.split(".")[0], set())) for name, path in known.items()}
    assert {k: v for k, v in upward.items() if v} == {}
    assert sum(1 for n in known if n.startswith("node_render.")) >= 10, "the walk found the renderer's modules"


def test_no_module_is_longer_than_one_reader_holds() -> None:
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
    # Room to grow: none within MARGIN lines of the cap (a module near the cap is split before it is edited).
    assert {name: n for name, n in lengths.items() if n > MAX_LINES - MARGIN} == {}


def test_every_command_is_a_module_of_its_own() -> None:
    from cluster_ops.cli import build_parser
    from cluster_ops.commands import COMMANDS

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = sorted(sub.choices)  # type: ignore[arg-type]
    assert names == sorted(["plan", "recipes", "preflight", "blocks", "pin-ami", "deploy", "destroy", "diff", "status", "wait-ready", "keys", "bench",
                            "size", "save-cache", "local"])  # fmt: skip
    assert sorted(c.__name__.rsplit(".", 1)[1].replace("_", "-") for c in COMMANDS) == names


def test_the_userdata_readme_places_every_script_and_unit_in_a_stage() -> None:
    readme = (ROOT / "userdata" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "userdata" / "bin").iterdir())
    units = sorted(p.name.removesuffix(".j2") for p in (ROOT / "userdata" / "units").iterdir())
    missing = [s for s in scripts if f"`{s}`" not in readme]
    missing += [u for u in units if f"`{u}`" not in readme and f"`{u.rsplit('.', 1)[0]}.service`, `.timer`" not in readme]
    assert missing == []


# Where a newcomer finds the tests of X: under the folder named for X's package (or for the kind of
# run: the templates, the local lifecycle, the booted VMs, the benchmarks, the project itself).
TEST_FOLDERS = {"clusterspec", "node_render", "userdata", "cluster_ops", "stacks", "lifecycle", "vm", "project", "bench"}
TEST_MODULE_LINES = 520
# The VM scenarios run in order on one booted cluster (each scenario starts from the last one's state).
LONG_TEST_MODULES = {"tests/vm/test_boot.py"}


def test_tests_mirror_the_source_and_stay_short() -> None:
    modules = sorted((ROOT / "tests").rglob("test_*.py"))
    assert len(modules) > 40, "the walk found the test modules"
    misplaced = [str(p.relative_to(ROOT)) for p in modules if p.relative_to(ROOT / "tests").parts[0] not in TEST_FOLDERS]
    assert misplaced == []
    long = {str(p.relative_to(ROOT)): n for p in modules if (n := len(p.read_text().splitlines())) > TEST_MODULE_LINES}
    assert {k: v for k, v in long.items() if k not in LONG_TEST_MODULES} == {}
    # Every package of the source has its folder of tests (the constructs' and the stack's: the templates, tests/stacks).
    assert {{"cluster_constructs": "stacks"}.get(p, p) for p in PACKAGES} <= TEST_FOLDERS
