"""`report_to: wandb` and `report_to: mlflow` (finetune.train.tracking, finetune.memory.callback): one 2-process run
reporting to both, W&B offline and MLflow on a local file store, read back from what each stored: one run in each,
the loss and learning rate as Trainer logged them, both ranks' `memory/*`, `throughput/*`, the final evaluation, and
the effective configuration as run parameters. Then the parameters' flattening for MLflow, in process."""

import enum
import json
import math
import struct
from types import SimpleNamespace

import pytest
from support import CPU_LAUNCHES, PROJECT_ROOT, assert_succeeded, launch_demo

from finetune.errors import RecipeError
from finetune.recipe.parse import parse_recipe
from finetune.train.tracking import TrackedRunCallback, flatten, mlflow_params, run_parameters

MEMORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    root = tmp_path_factory.mktemp("tracking")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_PROJECT": "finetune-tests",
           "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(), "MLFLOW_EXPERIMENT_NAME": "finetune-tests",
           "MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow 3 refuses its file store unless told; sqlite needs SQLAlchemy
    result = launch_demo(CPU_LAUNCHES["ddp"], root / "out", "--report_to", "wandb", "mlflow", env=env)
    assert_succeeded(result)
    output_dir = root / "out"
    return {"root": root, "uri": env["MLFLOW_TRACKING_URI"],
            **{name: json.loads((output_dir / f"{name}.json").read_text())
               for name in ("trainer_state", "memory_report", "effective_config")}}


def logged(run, key) -> list[tuple[int, float]]:
    return [(entry["step"], entry[key]) for entry in run["trainer_state"]["log_history"] if key in entry]


def measured(run, rank: int) -> dict:
    return run["memory_report"]["ranks"][rank]["measured"]


def effective_values(run) -> dict:
    return {name: entry["value"] for name, entry in run["effective_config"]["values"].items()}


def wandb_records(path):
    """The records of a `.wandb` file: LevelDB's log format (a 7-byte file header, then in 32 KiB blocks chunks of
    crc32c, length, type: full, first, middle, last) holding `wandb_internal_pb2.Record`s. wandb 0.31 reads it in
    its Go core only (`wandb sync`), with no Python reader left (wandb.sdk.internal.datastore was this)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    offset, pending, block = 7, b"", 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        chunk, offset = data[offset + 7:offset + 7 + length], offset + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4) and pending:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def item_key(item) -> str:
    """An item's name: its `key`, or its `nested_key` path (a one-element path for a flat name)."""
    return item.key or ".".join(item.nested_key)


@pytest.fixture(scope="module")
def wandb_run(tracked_run):
    """The only W&B run: its history rows by Trainer's step and its config, as the offline run's file holds them."""
    runs = list((tracked_run["root"] / "wandb").glob("*run-*"))
    assert len(runs) == 1 and runs[0].name.startswith("offline-run-"), runs  # rank 0 alone started one
    (path,) = runs[0].glob("*.wandb")
    rows, config = {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item_key(item): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(row["train/global_step"], {}).update(row)
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update({item_key(item): json.loads(item.value_json) for item in updates})
    return {"rows": rows, "config": config}


@pytest.fixture(scope="module")
def mlflow_run(tracked_run):
    """The only MLflow run, and the history of each of its metrics."""
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracked_run["uri"])
        experiments = [experiment.experiment_id for experiment in client.search_experiments()]
        runs = client.search_runs(experiments)
        assert len(runs) == 1, [run.info.run_name for run in runs]  # rank 0 alone, and the final evaluation in it
        (run,) = runs
        history = {key: [(metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, key)]
                   for key in run.data.metrics}
    return {"run": run, "history": history}


def wandb_series(wandb_run, key) -> list[tuple[int, float]]:
    return [(step, row[key]) for step, row in sorted(wandb_run["rows"].items()) if key in row]


@pytest.mark.distributed
def test_wandb_history_holds_loss_learning_rate_both_ranks_memory_and_throughput(tracked_run, wandb_run):
    for key in ("loss", "learning_rate", "throughput/tokens_per_second", "throughput/step_seconds"):
        expected = logged(tracked_run, key)
        assert [step for step, _ in wandb_series(wandb_run, f"train/{key}")] == [step for step, _ in expected]
        assert [value for _, value in wandb_series(wandb_run, f"train/{key}")] == \
            pytest.approx([value for _, value in expected], rel=1e-12)
    assert [step for step, _ in logged(tracked_run, "loss")] == [1, 2, 3]
    assert all(math.isfinite(loss) for _, loss in wandb_series(wandb_run, "train/loss"))
    assert [step for step, _ in wandb_series(wandb_run, "train/throughput/tokens_per_second")] == [2, 3]
    assert all(value > 0 for _, value in wandb_series(wandb_run, "train/throughput/tokens_per_second"))
    for key in MEMORY_KEYS:
        assert wandb_series(wandb_run, f"train/memory/{key}") == [(1, measured(tracked_run, 0)[key])]
        assert wandb_series(wandb_run, f"train/memory/rank_1/{key}") == [(1, measured(tracked_run, 1)[key])]
    (eval_loss,) = [value for _, value in logged(tracked_run, "eval_loss")]
    assert wandb_series(wandb_run, "eval/loss") == [(3, pytest.approx(eval_loss, rel=1e-12))]


@pytest.mark.distributed
def test_wandb_config_holds_the_effective_config_beside_trainers_arguments(tracked_run, wandb_run):
    config = wandb_run["config"]
    for name, value in effective_values(tracked_run).items():
        assert config[f"finetune/{name}"] == value, name
    assert config["finetune/strategy"] == "ddp" and config["finetune/global_batch_size"] == 32
    assert config["finetune/world_size"] == 2
    assert (config["finetune/model_name_or_path"], config["finetune/dataset"], config["finetune/method"]) == \
        ("tiny", "synthetic", "sft")
    assert config["finetune/use_lora"] is False and config["finetune/lora_r"] == 16
    assert config["learning_rate"] == 2e-3 and config["max_steps"] == 3  # Trainer's own, from WandbCallback


@pytest.mark.distributed
def test_mlflow_metrics_hold_loss_learning_rate_both_ranks_memory_throughput_and_the_final_evaluation(
        tracked_run, mlflow_run):
    history = mlflow_run["history"].get
    for key in ("loss", "learning_rate", "throughput/tokens_per_second", "throughput/step_seconds", "eval_loss"):
        expected = logged(tracked_run, key)
        assert [step for step, _ in history(key)] == [step for step, _ in expected], key
        assert [value for _, value in history(key)] == pytest.approx([value for _, value in expected], rel=1e-12)
    assert [step for step, _ in history("loss")] == [1, 2, 3]
    for key in MEMORY_KEYS:
        assert history(f"memory/{key}") == [(1, measured(tracked_run, 0)[key])]
        assert history(f"memory/rank_1/{key}") == [(1, measured(tracked_run, 1)[key])]
    assert mlflow_run["run"].info.status == "FINISHED"


@pytest.mark.distributed
def test_mlflow_params_hold_the_effective_config_beside_trainers_arguments(tracked_run, mlflow_run):
    params = mlflow_run["run"].data.params
    for name, value in effective_values(tracked_run).items():
        assert params[f"finetune/{name}"] == str(value), name
    assert (params["finetune/model_name_or_path"], params["finetune/method"], params["finetune/use_lora"]) == \
        ("tiny", "sft", "False")
    assert params["learning_rate"] == "0.002" and params["strategy"] == "zero2"  # Trainer's own: the recipe's key


def test_report_to_takes_several_trackers_on_the_command_line(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert parse_recipe("recipes/demo.yaml", ["--report_to", "wandb", "mlflow"]).training.report_to == \
        ["wandb", "mlflow"]
    assert parse_recipe("recipes/demo.yaml", []).training.report_to == ["tensorboard"]
    assert parse_recipe("recipes/demo.yaml", ["--report_to", "none"]).training.report_to == []


def test_run_parameters_are_the_recipes_own_sections_and_the_effective_values():
    recipe = parse_recipe("recipes/demo.yaml", ["--use_lora", "true", "--lora_target_modules", "q_proj", "v_proj"])
    effective = {"values": {"strategy": {"value": "deepspeed", "source": "launcher"},
                            "dataset_mixture": {"value": {"seed": 1, "datasets": [{"path": "a.jsonl"}]},
                                                "source": "recipe"}}}
    parameters = run_parameters(recipe, effective)
    assert parameters["finetune/model_name_or_path"] == "tiny" and parameters["finetune/method"] == "sft"
    assert parameters["finetune/use_lora"] is True
    assert parameters["finetune/lora_target_modules"] == ["q_proj", "v_proj"]
    assert parameters["finetune/strategy"] == "deepspeed"
    assert parameters["finetune/dataset_mixture/seed"] == 1
    assert parameters["finetune/dataset_mixture/datasets"] == [{"path": "a.jsonl"}]
    assert "finetune/output_dir" not in parameters and "finetune/learning_rate" not in parameters  # Trainer logs those


def test_flatten_names_nested_values_by_their_path_and_enums_by_their_value():
    class Kind(enum.Enum):
        LINEAR = "linear"

    assert flatten({"a": 1, "b": {"c": {"d": None}, "e": [1, 2]}, "f": Kind.LINEAR, "g": {}}, "finetune") == {
        "finetune/a": 1, "finetune/b/c/d": None, "finetune/b/e": [1, 2], "finetune/f": "linear", "finetune/g": {}}


def test_mlflow_params_are_names_and_text_mlflow_accepts():
    validation = pytest.importorskip("mlflow.utils.validation")
    parameters = {"finetune/ok": 0.5, "finetune/odd(name)!": None, "finetune/a//b": 1, "finetune/../up": 2,
                  "finetune/long": "x" * 50, "finetune/" + "k" * 30 + "/.": 3}
    params = mlflow_params(parameters, max_key_length=30, max_value_length=10)
    assert params == {"finetune/ok": "0.5", "finetune/odd_name__": "None", "finetune/a/_/b": "1",
                      "finetune/_/up": "2", "finetune/long": "x" * 10, "finetune/" + "k" * 21: "3"}
    for name in params:
        validation._validate_param_name(name)  # raises on a name MLflow refuses


def test_mlflow_keeps_a_resumed_runs_params_and_the_run_is_taken_up_again_after_training(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    with mlflow.start_run() as run:  # as MLflowCallback would have started it: one param held already
        mlflow.log_param("finetune/lora_r", "8")
        callback = TrackedRunCallback({"finetune/lora_r": 16, "finetune/method": "sft"})
        callback.on_train_begin(SimpleNamespace(report_to=["mlflow"]), SimpleNamespace(is_world_process_zero=True),
                                None)
    assert mlflow.active_run() is None  # ended, as MLflowCallback ends it when training ends
    callback.on_train_end(None, None, None)
    assert mlflow.active_run().info.run_id == run.info.run_id
    mlflow.end_run()
    assert mlflow.get_run(run.info.run_id).data.params == {"finetune/lora_r": "8", "finetune/method": "sft"}


@pytest.fixture
def no_tracker_setup(monkeypatch, tmp_path):
    """No W&B key, mode or netrc entry, and no MLflow URI, in an empty working directory."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI",
                 "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_wandb_without_a_login_stops_while_the_recipe_is_read_naming_the_fix(no_tracker_setup, monkeypatch):
    with pytest.raises(RecipeError, match=r"^`report_to: wandb` but W&B has no key for api.wandb.ai \(no "
                                          r"WANDB_API_KEY, nothing in .*netrc\): run `wandb login`, or set "
                                          r"WANDB_MODE=offline"):
        parse_recipe(str(PROJECT_ROOT / "recipes/demo.yaml"), ["--report_to", "wandb"])
    (no_tracker_setup / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert parse_recipe(str(PROJECT_ROOT / "recipes/demo.yaml"), ["--report_to", "wandb"]).training.report_to == [
        "wandb"]  # `wandb login` wrote the key
    (no_tracker_setup / "netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    parse_recipe(str(PROJECT_ROOT / "recipes/demo.yaml"), ["--report_to", "wandb"])


def test_mlflow_without_a_tracking_uri_names_its_default_store_and_what_it_lacks(no_tracker_setup, monkeypatch):
    import importlib.util

    demo = str(PROJECT_ROOT / "recipes/demo.yaml")
    if importlib.util.find_spec("sqlalchemy") is None:  # mlflow-skinny: MLflow 3's default sqlite store cannot open
        with pytest.raises(RecipeError, match=r"^`report_to: mlflow` logs to MLflow's default store, "
                                              r"sqlite:///mlflow.db \(no MLFLOW_TRACKING_URI\), which needs "
                                              r"sqlalchemy.*: pip install mlflow, or set MLFLOW_TRACKING_URI"):
            parse_recipe(demo, ["--report_to", "mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (no_tracker_setup / "mlruns").as_uri())
    with pytest.raises(RecipeError, match=r"a file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true"):
        parse_recipe(demo, ["--report_to", "mlflow"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert parse_recipe(demo, ["--report_to", "mlflow"]).training.report_to == ["mlflow"]
