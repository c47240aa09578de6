"""The notebooks: stored without outputs, switchable to the tiny default by one parameter, and executed here on CPU
(papermill, as CI and Colab users run them) so they cannot rot."""

import json

import nbformat
import papermill
import pytest
from support import PROJECT_ROOT

NOTEBOOKS = sorted((PROJECT_ROOT / "notebooks").glob("*.ipynb"))
TRAINING_NOTEBOOKS = {"01_full_finetune.ipynb": ["."], "02_lora_qlora_t4.ipynb": ["lora"],
                      "04_preference_dpo.ipynb": ["sft"], "05_reward_grpo.ipynb": ["sft"],
                      "06_vision_language.ipynb": ["."]}
# DPO runs: the held-out reward accuracy rises from 0 (before the first step the policy is the reference).
PREFERENCE_NOTEBOOKS = {"04_preference_dpo.ipynb": "dpo"}


def code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def test_the_six_notebooks_are_shipped():
    assert [path.name for path in NOTEBOOKS] == ["01_full_finetune.ipynb", "02_lora_qlora_t4.ipynb",
                                                 "03_memory_planning.ipynb", "04_preference_dpo.ipynb",
                                                 "05_reward_grpo.ipynb", "06_vision_language.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_stored_stripped_with_an_install_cell_and_a_tiny_switch(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    cells = code_cells(notebook)
    assert all(cell.outputs == [] and cell.execution_count is None for cell in cells), "outputs must be stripped"
    assert "%pip install" in cells[0].source  # Colab's install cell comes first (what it installs: test_packaging)
    parameters = [cell for cell in cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(parameters) == 1 and "TINY = False" in parameters[0].source
    source = "\n".join(cell.source for cell in cells)
    assert "from finetune" in source and "Trainer(" not in source  # the package trains; no copied training loop


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_on_the_tiny_default_and_draws_its_plots(path, tmp_path):
    declared = papermill.inspect_notebook(str(path))
    parameters = {"TINY": True, "OUTPUT_DIR": str(tmp_path / "outputs")}
    executed = papermill.execute_notebook(
        str(path), str(tmp_path / path.name), parameters={k: v for k, v in parameters.items() if k in declared},
        cwd=str(path.parent), kernel_name="python3", progress_bar=False,
    )
    for cell in code_cells(executed):
        kinds = {key for output in cell.outputs for key in output.get("data", {})}
        if "plot_" in cell.source or "Image(" in cell.source:
            assert "image/png" in kinds, f"no plot from:\n{cell.source}"
    tables = [cell for cell in code_cells(executed) if cell.source.rstrip().endswith("results")]
    assert tables and "<table" in tables[-1].outputs[0]["data"]["text/html"], "no results table at the end"
    for run in TRAINING_NOTEBOOKS.get(path.name, []):
        summary = json.loads((tmp_path / "outputs" / run / "eval_results.json").read_text())
        assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] - 0.5
    if path.name in PREFERENCE_NOTEBOOKS:
        summary = json.loads((tmp_path / "outputs" / PREFERENCE_NOTEBOOKS[path.name] / "eval_results.json").read_text())
        assert summary["method"] == "dpo" and summary["before"]["reward_accuracy"] == 0.0
        assert summary["after"]["reward_accuracy"] > 0.8, summary["after"]
    if path.name == "05_reward_grpo.ipynb":  # the reward model learns to rank; GRPO reports and measures its round
        reward = json.loads((tmp_path / "outputs" / "reward" / "eval_results.json").read_text())
        assert reward["after"]["pair_accuracy"] > reward["before"]["pair_accuracy"]
        grpo = json.loads((tmp_path / "outputs" / "grpo" / "eval_results.json").read_text())
        assert grpo["method"] == "grpo" and len(grpo["after"]["rewards"]) == 2  # the exact match and the scorer
        assert "exact_match" in grpo["after"]["rewards"] and "mean_reward" in grpo["before"]
        rank = json.loads((tmp_path / "outputs" / "grpo" / "memory_report.json").read_text())["ranks"][0]
        assert rank["measured"]["reward_models_bytes"] == rank["predicted"]["reward_models_bytes"] > 0
        assert rank["measured"]["generation_cache"]["bytes"] > 0
