"""The package's shape: no import cycle between its parts (its folders), `configs/` a leaf, the README's Layout table
one line per folder, DPO named only in its method's home, `train()` free of method branches, and a recipe parsed
without the trainer layer. `ruff check` runs in `make test` itself."""

import ast
import json
import re
import subprocess
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


def layout_rows() -> dict[str, str]:
    """The README's Layout table: path → what."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return {match[1]: match[2] for match in re.finditer(r"^\| `([^`]+)`[^|]*\| (.*) \|$", section, flags=re.M)}


def package_folders() -> set[str]:
    return {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}


def test_readme_layout_has_one_line_per_folder_of_the_package():
    rows = layout_rows()
    named = {path.removeprefix("finetune/").rstrip("/") for path in rows if path.startswith("finetune/") and
             path != "finetune/"}
    folders = package_folders()
    assert named == folders, f"README lacks {sorted(folders - named)}, names {sorted(named - folders)}"


def test_readme_layout_names_the_top_level_modules_and_each_folder_names_only_its_own_files():
    rows = layout_rows()
    top = set(re.findall(r"`([\w]+\.py)`", rows["finetune/"]))
    assert top == {p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    for folder in package_folders():
        for name in re.findall(r"`([\w/]+\.py|[\w/]+/)`", rows[f"finetune/{folder}/"]):
            assert (PACKAGE / folder / name).exists(), f"README's finetune/{folder}/ row names {name}, not there"


def test_readme_layout_paths_exist():
    for path in layout_rows():
        for part in path.split("`, `"):
            assert (PROJECT_ROOT / part).exists(), part


def test_the_architecture_guide_names_only_paths_that_exist():
    guide = (PROJECT_ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`(finetune/[\w/.]+)`", guide))
    assert len(paths) > 20
    for path in paths:
        assert (PROJECT_ROOT / path).exists(), f"docs/architecture.md names {path}, which does not exist"


def test_the_tests_mirror_the_package_folders():
    tests = PROJECT_ROOT / "tests"
    folders = {path.name for path in tests.iterdir() if path.is_dir() and any(path.glob("test_*.py"))}
    extra = folders - package_folders()
    assert folders and not extra, f"test folders with no package folder: {extra}"
    top = {path.stem.removeprefix("test_") for path in tests.glob("test_*.py")}
    assert top <= {"docs", "layout", "notebooks", "packaging"} | {p.stem for p in PACKAGE.glob("*.py")}, top


# The DPO method's home and the registry that names it; nowhere else in the library is DPO named.
DPO_HOME = ("finetune/train/methods/dpo/", "finetune/recipe/methods.py")


def test_dpo_is_named_only_in_its_method_home_and_the_registry():
    named = sorted(str(path.relative_to(PROJECT_ROOT)) for path in PACKAGE.rglob("*.py")
                   if "dpo" in path.read_text().lower())
    outside = [path for path in named if not path.startswith(DPO_HOME)]
    assert not outside, f"DPO is named outside its home: {outside}"
    assert "finetune/train/methods/dpo/__init__.py" in named and "finetune/recipe/methods.py" in named


def test_train_has_no_method_branches():
    """`train()` asks the method; it never compares the method to a name or tests a method's class."""
    source = (PACKAGE / "train" / "run.py").read_text()
    tree = ast.parse(source)
    train = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train")
    for node in ast.walk(train):
        if isinstance(node, ast.Compare):
            compared = ast.unparse(node)
            assert "method" not in compared, f"train() branches on the method: {compared}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert node.value.lower() not in ("sft", "dpo"), f"train() names a method: {node.value!r}"


# Modules a recipe must not load: the trainer layer, checkpoints, and TRL's trainers (TRL's configs are allowed; one of
# trl.experimental is read from its own file, since its package imports the trainer beside it).
TRAINER_LAYER = ("finetune.train.run", "finetune.train.trainer", "finetune.train.methods.dpo.trainer",
                 "finetune.checkpoints", "transformers.trainer", "trl.trainer.dpo_trainer", "trl.trainer.sft_trainer")


def test_parsing_any_shipped_recipe_imports_no_trainer_checkpoints_or_trls_trainers():
    script = ("import json, sys\n"
              "from finetune.recipe import parse_recipe\n"
              "recipes = sys.argv[1:]\n"
              "methods = [parse_recipe(recipe).method.name for recipe in recipes]\n"
              "print(json.dumps({'methods': methods, 'modules': sorted(sys.modules)}))\n")
    recipes = sorted(str(path) for path in (PROJECT_ROOT / "recipes").glob("*.yaml"))
    result = subprocess.run([sys.executable, "-c", script, *recipes], capture_output=True, text=True,
                            cwd=PROJECT_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"sft", "dpo", "kto", "cpo", "grpo"} <= set(record["methods"])  # each kind of recipe was parsed
    # TRL's config class is what a preference recipe builds
    assert {"trl.trainer.dpo_config", "trl.trainer.kto_config", "trl.experimental.cpo.cpo_config",
            "trl.trainer.grpo_config"} <= set(
        record["modules"])
    loaded = [name for name in record["modules"] if name == "transformers.trainer" or
              any(name == layer or name.startswith(layer + ".") for layer in TRAINER_LAYER)
              or (name.startswith("finetune.train.methods.") and name.endswith("trainer"))]
    trl_trainers = [name for name in record["modules"] if name.startswith("trl.") and name.endswith("_trainer")]
    assert not loaded and not trl_trainers, f"parsing a recipe loaded {loaded + trl_trainers}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_train_has_no_axis_branches():
    """`train()` asks the recipe's axes (finetune.axes); it never compares the strategy's kind, names an axis or
    imports an axis's runner."""
    from finetune.axes import AXES

    source = (PACKAGE / "train" / "run.py").read_text()
    train = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "train")
    for node in ast.walk(train):
        if isinstance(node, ast.Compare):
            compared = ast.unparse(node)
            assert ".kind" not in compared, f"train() branches on the strategy: {compared}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert node.value not in AXES, f"train() names an axis: {node.value!r}"
    assert "axis.run(" in ast.unparse(train) or "runner.run(" in ast.unparse(train)  # the runner is asked
    assert not {name for name in imported_modules(PACKAGE / "train" / "run.py") if ".axes." in name
                or name.endswith(".pipeline")}, "run.py imports an axis's home"


# The pipeline axis's home (with its checkpoint files, in the checkpoints layer) and the registry that names it
# (finetune.axes). The launch's strategy and the estimator carry its layout as their `axis`
# (finetune.train.axes.pipeline.layout) and ask it what they need, without naming it.
REGISTRY = "finetune/axes.py"
# files beside an axis's folder that are part of its home
HOME_BESIDE = {"pipeline": ("finetune/checkpoints/pipeline_stages.py",)}


def axis_home(name: str) -> tuple[str, ...]:
    """An axis's home: the folder (or module) its registry line names, and the files beside it that belong to it."""
    from finetune.axes import AXES

    module = AXES[name].partition(":")[0].replace(".", "/")
    folder = f"{module}/" if (PROJECT_ROOT / module).is_dir() else f"{module}.py"
    return (folder, *HOME_BESIDE.get(name, ()))


def compared_axis_names(path, names) -> list[str]:
    """Comparisons in `path` against an axis's name (`kind == "pipeline"`, `strategy in ("pipeline", ...)`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            constants = {item.value for item in ast.walk(node) if isinstance(item, ast.Constant)}
            found += [ast.unparse(node) for name in names if name in constants]
    return found


@pytest.mark.parametrize("name", ["sequence_parallel", "tensor_parallel", "context_parallel", "pipeline"])
def test_each_axis_is_named_only_in_its_home(name):
    """As DPO for methods: a file outside an axis's home and the registry naming one of its recipe keys
    (`sequence_parallel_size`, `pipeline_schedule`, ...), or branching on its name (`kind == "pipeline"`), fails
    here."""
    import dataclasses

    from finetune.axes import AXES, axis_class

    assert set(AXES) >= {"sequence_parallel", "tensor_parallel", "context_parallel", "pipeline"}
    home = (*axis_home(name), REGISTRY)
    axis = axis_class(name)
    keys = re.compile("|".join(rf"\b{field.name}\b" for field in dataclasses.fields(axis.arguments)))
    named = {str(path.relative_to(PROJECT_ROOT)) for path in PACKAGE.rglob("*.py") if keys.search(path.read_text())}
    outside_keys = {path for path in named if not path.startswith(home)}
    assert outside_keys == set(), f"{name}'s keys outside its home: {outside_keys}"
    branches = {str(path.relative_to(PROJECT_ROOT)): compared_axis_names(path, [name])
                for path in PACKAGE.rglob("*.py")}
    outside = {path: found for path, found in branches.items() if found and not path.startswith(home)}
    assert outside == {}, f"branches on {name}'s name outside its home: {outside}"
    assert f"{axis_home(name)[0]}__init__.py" in named  # the rule reads the files it means


def test_the_axis_rule_finds_a_planted_branch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('def f(strategy):\n    return strategy.kind in ("ddp", "pipeline")\n')
    assert compared_axis_names(planted, ["pipeline"]) == ['strategy.kind in (\'ddp\', \'pipeline\')']
