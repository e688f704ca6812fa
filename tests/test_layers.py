"""The package's layers are real: every import (module level or inside a function) goes down the order
core → algorithm → model → rollout → tasks → tiny → training → serve → experiment → integrations → api → cli, or
stays within its layer, and no two modules import each other, directly or around a loop. A registry entry in
``sao.core.registry`` names its implementation by import path, resolved on use: that is how a lower layer offers a
name a higher one implements, and a test below checks that every such path resolves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "sao"
LAYERS = (
    "core",
    "algorithm",
    "model",
    "rollout",
    "tasks",
    "tiny",
    "training",
    "serve",
    "experiment",
    "integrations",
    "api",
    "cli",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """Rank of a module's layer; the top-level ``sao`` package (lazy re-exports of the API) and ``__main__`` count
    as the top, with the cli."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return LAYERS.index("cli")
    return LAYERS.index(parts[1])


def imports(path: Path, modules: set[str]) -> set[str]:
    """Every sao module ``path`` imports anywhere in its body (``from sao.x import y`` names module
    sao.x.y when that is a module, else sao.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "sao"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sao":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path, set(files)) - {name} for name, path in files.items()}


def test_the_layers_are_the_folders():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {"api", "cli"}
    assert {p.name for p in PACKAGE.glob("*.py")} == {"__init__.py", "__main__.py", "api.py", "cli.py"}


def test_the_tests_mirror_the_layers():
    """tests/<layer>/ for each layer's modules (tests/cli/ for the command line and sao.api); at the top only the
    checks of the package as a whole: its layers, its docs, its bench and its minimal example."""
    tests = Path(__file__).resolve().parent
    folders = {
        p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__")) and p.name != "fixtures"
    }
    assert folders <= set(LAYERS) - {"api"}, sorted(folders - set(LAYERS))
    assert {p.name for p in tests.glob("test_*.py")} == {
        "test_layers.py",
        "test_docs.py",
        "test_bench.py",
        "test_minimal_example.py",
    }


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} -> {dep}" for m, deps in graph().items() for dep in deps if layer(dep) > layer(m)]
    assert upward == [], "imports must go down the layers:\n" + "\n".join(sorted(upward))


def test_there_is_no_import_cycle():
    edges, cycles = graph(), []

    def visit(node: str, path: list[str]) -> None:
        for dep in sorted(edges.get(node, ())):
            if dep in path:
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in seen:
                seen.add(dep)
                visit(dep, [*path, dep])

    for start in sorted(edges):
        seen = {start}
        visit(start, [start])
    assert cycles == [], "import cycles:\n" + "\n".join(sorted(set(cycles)))


def private_imports(path: Path) -> list[str]:
    """The names ``path`` imports from another sao module that begin with one underscore (a module's own business)."""
    return [
        f"{node.module}.{alias.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sao"
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_no_module_imports_another_modules_private_name(tmp_path):
    found = [f"{module_name(p)} imports {name}" for p in sorted(PACKAGE.rglob("*.py")) for name in private_imports(p)]
    assert found == [], "what a module shares has a public name:\n" + "\n".join(found)
    fake = tmp_path / "x.py"  # the check itself
    fake.write_text("def f():\n    from sao.rollout.ray_fleet import RayFleet, _Hidden\n")
    assert private_imports(fake) == ["sao.rollout.ray_fleet._Hidden"]


@pytest.mark.parametrize("bad", ["sao.training.trainer", "sao.cli"])
def test_the_checks_catch_an_upward_import(tmp_path, bad):
    """The checker itself: a core module that imports a higher layer is reported."""
    fake = tmp_path / "sao" / "core" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"def f():\n    import {bad}\n")
    found = imports(fake, {bad})
    assert found == {bad} and layer(bad) > layer("sao.core.x")


def test_every_registry_entry_resolves_to_an_implementation():
    from sao.core import registry

    for name in ("PRESETS", "CORRECTIONS", "BASELINES", "MODELS", "TASK_SETS", "ENVIRONMENTS"):
        reg = getattr(registry, name)
        for entry in reg:
            assert reg.get(entry) is not None, f"{name}[{entry!r}]"


def test_every_source_names_an_implementation_with_a_build():
    """The rollout layer's registry: each source's settings section names the class that builds it."""
    import importlib

    from sao.core.config import sources

    assert sources() is importlib.import_module("sao.rollout.registry").SOURCES
    for kind in sources():
        module, _, name = sources().get(kind).implementation.partition(":")
        assert callable(getattr(getattr(importlib.import_module(module), name), "build", None)), kind


def test_core_imports_no_torch_at_module_level():
    """core/ is what every layer needs; it loads torch only inside the functions that use it."""
    for path in (PACKAGE / "core").glob("*.py"):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
        assert "torch" not in names, f"{path.name} imports torch at module level"


def test_the_public_api_still_imports_from_the_top():
    from sao import SAO, compare

    assert SAO().correction == "dis" and callable(compare)


def test_no_module_tests_a_source_by_name_outside_its_own():
    """A source owns its settings, checks and needs (``sao.rollout.registry``): no module compares a value with a
    source's name or its prefix (``== "traces"``, ``.startswith("vllm")``) but the modules of the sources
    themselves; ``Trainer`` and ``Experiment`` do not even read ``config.rollout.source``."""
    from sao.core.config import sources

    kinds = set(sources()) | {"engine"}
    own = {"registry.py", "sources.py", "ray_workers.py", "traces.py", "remote.py", "vllm.py"}
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "rollout" and path.name in own:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and re.search(r"rollout|source|engine", ast.unparse(node)):
                sides = [node.left, *node.comparators]
                sides += [e for c in sides if isinstance(c, ast.Tuple | ast.List | ast.Set) for e in c.elts]
                values = [c.value for c in sides if isinstance(c, ast.Constant)]
                assert not set(values) & kinds, f"{path.relative_to(PACKAGE)}:{node.lineno} tests a source by name"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
                args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                assert not any(k.startswith(a) for a in args for k in kinds if a), f"{path.name}:{node.lineno}"
    for path in (PACKAGE / "training" / "trainer.py", PACKAGE / "experiment" / "runner.py"):
        tree = ast.parse(path.read_text())
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not named & kinds, f"{path.name} names {sorted(named & kinds)}"
        sources_read = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and n.attr == "source"
            and isinstance(n.value, ast.Attribute)
            and n.value.attr == "rollout"
        ]
        assert not sources_read, f"{path.name} reads config.rollout.source"


def test_under_loadgroup_a_test_is_sent_with_its_files_group(request):
    """make test runs the suite on two pytest-xdist workers with --dist loadgroup: each test's node id carries its
    group (tests/conftest.py), which is what sends a file's tests, and every test on the vLLM server, to one worker."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs under pytest-xdist --dist loadgroup (make test)")
    assert request.node.nodeid.endswith("@tests/test_layers.py"), request.node.nodeid
