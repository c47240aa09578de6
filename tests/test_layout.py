"""The package's shape: no import cycle between its parts, `configs/` a leaf, and the README's Layout table naming
every module and folder there is (and nothing that is not). `ruff check` runs in `make test` itself."""

import ast
import re
import sys

import pytest
from support import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "finetune"


def part_of(module: str) -> str:
    """The part a module belongs to: its subpackage (`finetune.memory`), or itself for a top-level module."""
    names = module.split(".")
    return ".".join(names[:2]) if len(names) > 1 else module


def module_name(path) -> str:
    relative = path.relative_to(PROJECT_ROOT).with_suffix("")
    names = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(names)


def imported_modules(path) -> set[str]:
    """Every `finetune` module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("finetune")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("finetune"):
            for alias in node.names:  # `from finetune import outputs` imports the module finetune.outputs
                candidate = f"{node.module}.{alias.name}"
                is_module = (PROJECT_ROOT / candidate.replace(".", "/")).with_suffix(".py").is_file() or \
                    (PROJECT_ROOT / candidate.replace(".", "/")).is_dir()
                found.add(candidate if is_module else node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = part_of(module_name(path))
        targets = {part_of(name) for name in imported_modules(path)} - {source, "finetune"}
        graph.setdefault(source, set()).update(targets)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target] if target in path else [node, target]
            if target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_no_import_cycle_between_the_packages_parts():
    graph = import_graph()
    assert "finetune.launch" in graph["finetune.memory"]  # the graph is read, not empty
    assert find_cycle(graph) is None, f"import cycle: {' → '.join(find_cycle(graph))}"


def test_a_planted_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_configs_is_a_leaf():
    for path in (PACKAGE / "configs").glob("*.py"):
        outside = {name for name in imported_modules(path) if not name.startswith("finetune.configs")}
        assert not outside, f"{path.name} imports {outside}"


def layout_row(path: str) -> str:
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return next(line for line in section.splitlines() if line.startswith(f"| `{path}`"))


def test_readme_layout_names_every_module_and_folder_of_the_package():
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", layout_row("finetune/").split("|")[2]))
    present = {p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    present |= {f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert named == present, f"README lacks {sorted(present - named)}, names {sorted(named - present)}"


def test_readme_layout_paths_exist():
    readme = (PROJECT_ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    for path in re.findall(r"^\| `([^`]+)`", readme, flags=re.M):
        for part in path.split("`, `"):
            assert (PROJECT_ROOT / part).exists(), part


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
