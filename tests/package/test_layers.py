"""The package's shape: its public face, and imports that point down (docs/architecture.md)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import serve
from conftest import ROOT

SERVE = ROOT / "serve"
# Top floor first: a package imports only those after it (serve/formats/ holds its formats).
FLOORS = ["app", "http", "dialects", "service", "snapshots", "formats", "tokenizer", "engine", "core"]
# The neutral modules every implementation builds on: they import no implementation.
NEUTRAL = ["core", "engine/api.py", "engine/types.py", "formats/base.py", "dialects/exchange.py"]
IMPLEMENTATIONS = ("serve.formats.xtml", "serve.formats.template", "serve.engine.binding",
                   "serve.engine.abi", "serve.dialects.openai", "serve.dialects.anthropic",
                   "serve.dialects.responses", "serve.dialects.ollama")


def imports(path: Path) -> list[str]:
    """The serve modules `path` imports (`from serve.x import y` counts serve.x.y when y is one)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("serve."):
            package = SERVE / node.module[len("serve."):].replace(".", "/")
            found += [f"{node.module}.{a.name}" if (package / f"{a.name}.py").exists() else node.module
                      for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("serve.")]
    return found


def modules(under: str) -> list[Path]:
    path = SERVE / under
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def test_the_public_face_names_what_it_exports():
    assert serve.__all__ and len(set(serve.__all__)) == len(serve.__all__)
    for name in serve.__all__:
        assert getattr(serve, name) is not None, name


def test_no_import_runs_back_up_a_floor():
    upward = []
    for floor, package in enumerate(FLOORS):
        for path in modules(package):
            for module in imports(path):
                target = module.split(".")[1]
                if target in FLOORS and FLOORS.index(target) < floor:
                    upward.append(f"{path.relative_to(ROOT)} imports {module}")
    assert upward == []


def test_the_neutral_modules_import_no_implementation():
    reaching = [f"{path.relative_to(ROOT)} imports {module}"
                for under in NEUTRAL for path in modules(under) for module in imports(path)
                if module.startswith(IMPLEMENTATIONS)]
    assert reaching == []


def test_every_module_imports_on_its_own():
    for path in sorted(SERVE.rglob("*.py")):
        if path.name != "__main__.py":
            importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))


def test_no_two_modules_import_each_other_even_for_types():
    # TYPE_CHECKING imports count: a circle kept only for annotations is still one to read.
    graph = {".".join(path.relative_to(ROOT).with_suffix("").parts): set(imports(path))
             for path in SERVE.rglob("*.py")}
    state: dict[str, str] = {}
    circles = []

    def walk(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                circles.append(trail[trail.index(target):] + [target])
            elif target in graph and target not in state:
                walk(target, trail + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert circles == []


# The limits docs/architecture.md keeps: a module is read in one sitting, a class in one screenful of scrolls.
MODULE_LINES, CLASS_LINES = 500, 300


def test_modules_and_classes_stay_small():
    over = []
    for path in sorted(SERVE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            over.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > CLASS_LINES:
                    over.append(f"{path.relative_to(ROOT)}: class {node.name}, {lines} lines")
    assert over == []
