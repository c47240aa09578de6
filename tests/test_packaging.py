"""The distribution `finetune-kit` (import name and command `finetune`): a wheel built from this checkout carries all
the package reads at run time and installs offline into a fresh virtualenv, where `finetune` runs without the
checkout; the notebooks' install cells and Colab badges name the distribution and repository pyproject.toml names."""

import json
import os
import re
import shutil
import site
import sys
import zipfile
from configparser import ConfigParser
from email.parser import Parser
from pathlib import Path
from typing import NamedTuple

import nbformat
import pytest
from packaging.requirements import Requirement
from support import PROJECT_ROOT, assert_succeeded, run

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra installs tomli
    import tomli as tomllib

PROJECT = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
PACKAGE = PROJECT_ROOT / "finetune"
# pip reads no configuration file (PIP_CONFIG_FILE=/dev/null) and no PIP_* variable (--isolated), so no index, no
# find-links folder and no constraints file: with --no-index it installs only what it is given and what it sees.
OFFLINE = {"PIP_CONFIG_FILE": os.devnull}
PIP = ("-m", "pip", "--isolated")
NOTEBOOKS = sorted((PROJECT_ROOT / "notebooks").glob("*.ipynb"))
COLAB = "https://colab.research.google.com"
COLAB_BADGE = re.compile(re.escape(f"[![Open In Colab]({COLAB}/assets/colab-badge.svg)](") + r"([^)\s]+)\)")
PIP_MAGIC = re.compile(r'^\s*%pip install -q "([^"]+)"$', re.M)


def package_files() -> list[str]:
    """Every file of the package in the checkout, as the wheel names it."""
    return sorted(str(path.relative_to(PROJECT_ROOT)) for path in PACKAGE.rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts)


def this_environment() -> dict[str, int]:
    """The project's installation of itself (distribution, editable finder, console script), with modification times:
    installing the wheel elsewhere must not replace or remove any of it."""
    places = [Path(directory) for directory in site.getsitepackages()]
    found = [path for place in places for path in place.glob("*finetune*")]
    script = Path(sys.executable).parent / "finetune"
    return {str(path): path.stat().st_mtime_ns for path in [*found, *([script] if script.exists() else [])]}


def colab_url(notebook: Path) -> str:
    """Colab opens a notebook of a GitHub repository at the same path under its /github/ prefix."""
    repository = PROJECT["urls"]["Repository"]
    assert repository.startswith("https://github.com/")
    return f"{repository.replace('https://github.com/', f'{COLAB}/github/')}/blob/main/notebooks/{notebook.name}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of what the build reads, so build/ and *.egg-info land outside the checkout."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", PROJECT["readme"]):
        shutil.copy2(PROJECT_ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path_factory.mktemp("wheels")
    assert_succeeded(run([sys.executable, *PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "--wheel-dir", str(wheels), str(source)], env=OFFLINE, timeout=300))
    (built,) = wheels.glob("*.whl")
    return built


class FreshVenv(NamedTuple):
    python: Path
    finetune: Path
    site_packages: Path
    before: dict[str, int]
    after: dict[str, int]


def new_venv(root: Path) -> tuple[Path, Path]:
    """A new virtualenv that sees this environment's packages (a .pth file lists its site-packages, as
    --system-site-packages would list the interpreter's): pip resolves every dependency from what it sees or fails.
    pip comes from this environment too (`--without-pip`): the one ensurepip bundles brings a setuptools older than
    torch requires, which would shadow this environment's. Returns its python and site-packages."""
    assert_succeeded(run([sys.executable, "-m", "venv", "--without-pip", str(root)]))
    python = root / "bin" / "python"
    where = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    assert_succeeded(where)
    site_packages = Path(where.output.strip())
    (site_packages / "project_environment.pth").write_text("".join(f"{path}\n" for path in site.getsitepackages()))
    return python, site_packages


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> FreshVenv:
    """A new virtualenv with the wheel installed offline."""
    root = tmp_path_factory.mktemp("fresh") / "venv"
    python, site_packages = new_venv(root)
    before = this_environment()
    install = run([str(python), *PIP, "install", "--no-index", str(wheel)], env=OFFLINE, cwd=root, timeout=300)
    assert_succeeded(install)
    return FreshVenv(python, root / "bin" / "finetune", site_packages, before, this_environment())


def test_distribution_is_finetune_kit_with_the_finetune_command_and_every_package_file(wheel):
    assert PROJECT["name"] == "finetune-kit"  # `finetune` on PyPI is another project
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = ConfigParser()
        entry_points.read_string(archive.read(f"{info}/entry_points.txt").decode())
    assert metadata["Name"] == PROJECT["name"] and metadata["Version"] == PROJECT["version"]
    assert f"Repository, {PROJECT['urls']['Repository']}" in metadata.get_all("Project-URL")
    assert dict(entry_points["console_scripts"]) == {"finetune": "finetune.cli:main"}
    assert "finetune/datasets/synthetic/train.jsonl" in names
    missing = sorted(set(package_files()) - set(names))
    assert not missing, f"files of finetune/ left out of the wheel (package-data in pyproject.toml?): {missing}"


def test_wheel_installs_offline_into_a_fresh_venv_and_leaves_this_one_alone(fresh_venv):
    assert fresh_venv.finetune.is_file()
    assert (fresh_venv.site_packages / "finetune" / "__init__.py").is_file()
    assert fresh_venv.after == fresh_venv.before, "installing into the fresh venv changed this environment"


def test_installed_package_is_imported_from_the_fresh_venv_with_its_data(fresh_venv, tmp_path):
    # From tmp_path, so the checkout is not on sys.path; the synthetic data is found the way training finds it.
    probe = ("import json, finetune, importlib.metadata as m; from finetune.presets import synthetic_data_dir; "
             "print(json.dumps({'file': finetune.__file__, 'version': m.version('finetune-kit'), "
             "'__version__': finetune.__version__, 'data': str(synthetic_data_dir())}))")
    result = run([str(fresh_venv.python), "-c", probe], cwd=tmp_path)
    assert_succeeded(result)
    found = json.loads(result.output.splitlines()[-1])
    installed = fresh_venv.site_packages / "finetune"
    assert Path(found["file"]) == installed / "__init__.py"
    assert found["version"] == found["__version__"] == PROJECT["version"]
    assert Path(found["data"]).parent.parent == installed
    shipped = sorted(path.name for path in (PACKAGE / "datasets" / "synthetic").glob("*.jsonl"))
    assert sorted(path.name for path in Path(found["data"]).glob("*.jsonl")) == shipped


def test_installed_command_lists_the_subcommands(fresh_venv, tmp_path, monkeypatch):
    from finetune.cli import build_parser

    monkeypatch.setenv("COLUMNS", "120")  # argparse wraps help to the terminal's width
    result = run([str(fresh_venv.finetune), "--help"], cwd=tmp_path, env={"COLUMNS": "120"})
    assert_succeeded(result)
    assert build_parser().format_help() in result.output  # every subcommand, as the checkout's parser lists them


def test_installed_command_plans_and_writes_the_configs_without_the_checkout(fresh_venv, tmp_path):
    from finetune.generated_files import check_configs

    plan = run([str(fresh_venv.finetune), "plan", "--model", "tiny", "--gpus", "2", "--gpu-memory", "24"], cwd=tmp_path)
    assert_succeeded(plan)
    assert "Recommended: DDP" in plan.output
    written = run([str(fresh_venv.finetune), "configs", "write", "--out", "generated"], cwd=tmp_path)
    assert_succeeded(written)
    assert check_configs(tmp_path / "generated") == []  # the same files as this checkout's generator


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_installs_the_distribution_and_opens_in_colab_from_the_repository(path):
    notebook = nbformat.read(path, as_version=4)
    install = next(cell for cell in notebook.cells if cell.cell_type == "code")
    (spec,) = PIP_MAGIC.findall(install.source)
    requirement = Requirement(spec)
    assert requirement.name == PROJECT["name"]
    assert requirement.extras <= set(PROJECT["optional-dependencies"]) and "plots" in requirement.extras
    assert ("qlora" in requirement.extras) == ("qlora" in path.name)
    # Not on the package index yet: the cell installs from the repository (a name alone would fail on a fresh Colab).
    assert requirement.url == f"git+{PROJECT['urls']['Repository']}"
    assert 'if importlib.util.find_spec("finetune") is None:' in install.source  # nothing to do where installed
    badges = [url for cell in notebook.cells for url in COLAB_BADGE.findall(cell.source)]
    assert notebook.cells[0].cell_type == "markdown" and COLAB_BADGE.search(notebook.cells[0].source)
    assert badges == [colab_url(path)]


def test_notebooks_readme_badges_open_the_notebooks_of_the_repository():
    badges = COLAB_BADGE.findall((PROJECT_ROOT / "notebooks" / "README.md").read_text())
    assert badges == [colab_url(path) for path in NOTEBOOKS]



@pytest.mark.skipif(not (PROJECT_ROOT / ".git").exists() or shutil.which("git") is None,
                    reason="needs the project as a git repository")
def test_the_notebooks_install_cell_installs_from_the_repository_offline(tmp_path):
    """The install cell's own requirement, with the repository's address pointed at this checkout's git repository
    (what a fresh Colab gets from the real address): pip clones it, builds it and installs it with its extras offline,
    and the command runs from the fresh venv."""
    install = next(cell for cell in nbformat.read(NOTEBOOKS[0], as_version=4).cells if cell.cell_type == "code")
    (spec,) = PIP_MAGIC.findall(install.source)
    # file://localhost/...: the pip a venv bundles rejects a file URL without a host
    local = spec.replace(PROJECT["urls"]["Repository"], f"file://localhost{PROJECT_ROOT}")
    assert local != spec and Requirement(local).url.startswith("git+file://")
    python, site_packages = new_venv(tmp_path / "venv")
    result = run([str(python), *PIP, "install", "--no-index", "--no-build-isolation", local], env=OFFLINE,
                 cwd=tmp_path, timeout=300)
    assert_succeeded(result)
    assert (site_packages / "finetune" / "__init__.py").is_file()  # installed, not linked to the checkout
    plan = run([str(tmp_path / "venv" / "bin" / "finetune"), "plan", "--model", "tiny", "--gpus", "2",
                "--gpu-memory", "24"], cwd=tmp_path)
    assert_succeeded(plan)
    assert "Recommended: DDP" in plan.output
