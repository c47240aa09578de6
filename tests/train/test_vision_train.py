"""Vision-language fine-tuning end to end: the tiny Qwen2-VL learns the synthetic shapes on 2 processes under ZeRO-2
(full, its tower frozen, and LoRA), its frozen tower unchanged on every rank, the plan's model states equal to what
each rank held; the peers' data formats train; the plan counts image tokens as the processor does; and what comes
after training (chat, eval, serve, export) answers from the trained model with images.

The two 2-process runs are the catalogue's `vision/full` and `vision/lora` rows (tests/catalogue.py), read by every
test here that needs a trained model."""

import base64
import json
import re
import signal
import subprocess

import pytest
from PIL import Image
from support import PROJECT_ROOT, assert_succeeded, finetune_command, free_port, wait_for_models

from finetune.cli import main
from finetune.data.vision import synthetic
from finetune.data.vision.encode import encode_vision_conversation, image_token_count
from finetune.errors import RecipeError
from finetune.models.vision.presets import build_model, build_processor
from finetune.recipe.args import DataArguments

ONE_IMAGE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is this?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "circle"}]}]


@pytest.fixture(scope="module")
def processor():
    return build_processor()


def trained(catalogue, name: str):
    entry = catalogue[f"vision/{name}"]
    assert_succeeded(entry)
    return entry.output_dir


def drawn(tmp_path, shape: str, colour: str, seed: int):
    import random

    path = tmp_path / f"{shape}-{colour}-{seed}.png"
    synthetic.draw(shape, colour, 32, random.Random(seed)).save(path)
    return path


# --- the 2-process runs --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["full", "lora"])
def test_the_tiny_vlm_learns_the_shapes_under_zero2_on_2_processes_its_tower_unchanged(catalogue, name):
    import torch

    output_dir = trained(catalogue, name)
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert results["world_size"] == 2 and results["deepspeed_zero_stage"] == 2
    assert all(score == 0.0 for score in results["before"]["exact_match"].values())
    assert set(results["after"]["exact_match"]) == {"colour", "shape"}
    assert all(score >= 0.9 for score in results["after"]["exact_match"].values()), results["after"]
    assert results["frozen_weights_unchanged"] is True  # every frozen weight, checked on each rank
    summary = json.loads((output_dir / "data_summary.json").read_text())
    assert summary["sources"][0]["train"]["image_tokens"]["max_per_row"] == 4  # 32 × 32 pixels: 4 tokens
    if name == "full":  # the saved tower is the seeded one, bit for bit; the projector and language model moved
        from transformers import Qwen2VLForConditionalGeneration

        saved = Qwen2VLForConditionalGeneration.from_pretrained(output_dir).state_dict()
        fresh = build_model(build_processor(), seed=0).state_dict()
        tower = [key for key in fresh if ".visual." in f".{key}" and ".merger." not in key]
        assert tower and all(torch.equal(saved[key], fresh[key]) for key in tower)
        assert not torch.equal(saved["model.visual.merger.mlp.0.weight"], fresh["model.visual.merger.mlp.0.weight"])
    else:
        adapter = json.loads((output_dir / "adapter_config.json").read_text())
        assert "language_model" in adapter["target_modules"] and adapter["modules_to_save"] == ["merger"]


def test_the_plan_of_the_recipe_holds_what_each_rank_held(catalogue, capsys):
    output_dir = trained(catalogue, "full")
    assert main(["plan", "--recipe", "recipes/vision.yaml", "--gpus", "2", "--gpu-memory", "16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["trainable_parameters"] == 626_304  # all but the frozen tower's 91,520
    predicted = plan["your_strategy"]["per_gpu"]
    ranks = json.loads((output_dir / "memory_report.json").read_text())["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        for part in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            # ZeRO-2 splits the flat gradient and optimizer partitions with padding: within 3% on each rank
            assert rank["measured"][part] == pytest.approx(predicted[part], rel=0.03), (rank["rank"], part)


# --- after training --------------------------------------------------------------------------------------------------

def test_chat_with_an_image_answers_from_the_trained_model(catalogue, tmp_path, capsys):
    output_dir = trained(catalogue, "full")
    for shape, colour, seed in (("triangle", "blue", 5), ("circle", "green", 6), ("square", "red", 7)):
        image = drawn(tmp_path, shape, colour, seed)
        assert main(["chat", str(output_dir), "--image", str(image), "--prompt", "What shape is this?"]) == 0
        assert capsys.readouterr().out.strip() == shape
        assert main(["chat", str(output_dir), "--image", str(image), "--prompt", "What colour is the shape?"]) == 0
        assert capsys.readouterr().out.strip() == colour
    assert main(["chat", str(output_dir), "--image", str(tmp_path / "missing.png"), "--prompt", "?"]) == 2
    assert re.search(r"^finetune: error: --image: image `.*missing\.png` does not exist\.$",
                     capsys.readouterr().err, re.MULTILINE)


def write_image_task(folder, count: int = 12):
    import random

    rng = random.Random(9)
    (folder / "pics").mkdir(parents=True)
    with (folder / "shapes.jsonl").open("w") as file:
        for index in range(count):
            shape, colour = rng.choice(synthetic.SHAPES), rng.choice(list(synthetic.COLOURS))
            synthetic.draw(shape, colour, 32, rng).save(folder / "pics" / f"{index}.png")
            asked = ("colour", "shape")[index % 2]
            file.write(json.dumps({"messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": synthetic.QUESTIONS[asked]}]},
                {"role": "assistant", "content": [{"type": "text", "text": colour if asked == "colour" else shape}]}],
                "images": [f"pics/{index}.png"]}) + "\n")  # relative to the task file
    return folder / "shapes.jsonl"


def test_eval_on_an_image_task_scores_the_trained_model_against_its_base(catalogue, tmp_path, capsys):
    output_dir = trained(catalogue, "lora")
    task = write_image_task(tmp_path / "task")
    results = tmp_path / "results.json"
    assert main(["eval", str(output_dir), "--tasks", str(task), "--compare-base", "--output", str(results)]) == 0
    record = json.loads(results.read_text())
    assert record["before"]["shapes"]["exact_match"] == 0.0
    assert record["scores"]["shapes"]["exact_match"] >= 0.9
    answers = [json.loads(line) for line in (tmp_path / "results" / "shapes.answers.jsonl").read_text().splitlines()]
    assert len(answers) == 12 and all(row["doc"]["images"] == 1 for row in answers)
    capsys.readouterr()
    assert main(["eval", str(output_dir), "--tasks", "arc_easy", "--output", str(tmp_path / "other.json")]) == 2
    assert "lm-eval's tasks (arc_easy) are run through its text harness here, which cannot give it images" in \
        capsys.readouterr().err
    assert not (tmp_path / "other.json").exists()


def test_serve_answers_an_image_content_part_as_chat_does(catalogue, tmp_path, capsys):
    from openai import OpenAI

    output_dir = trained(catalogue, "lora")  # a LoRA run: merged into its base, written with its processor
    image = drawn(tmp_path, "triangle", "yellow", 11)
    port = free_port()
    served = tmp_path / "served"
    server = subprocess.Popen(
        finetune_command("serve", str(output_dir), "--port", str(port), "--model-name", "shapes",
                         "--export-dir", str(served)),
        cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_models(port, server)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        for question in ("What shape is this?", "What colour is the shape?"):
            answer = client.chat.completions.create(model="shapes", max_tokens=8, temperature=0, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}]).choices[0].message.content
            assert main(["chat", str(output_dir), "--image", str(image), "--prompt", question]) == 0
            assert answer == capsys.readouterr().out.strip() == ("triangle" if "shape is" in question else "yellow")
    finally:
        server.send_signal(signal.SIGTERM)
        _, errors = server.communicate(timeout=60)
    assert server.returncode == 0, errors
    assert (served / "processor_config.json").is_file()


def test_export_merges_the_lora_run_with_its_processor_and_gguf_is_refused_by_name(catalogue, tmp_path, capsys):
    output_dir = trained(catalogue, "lora")
    merged = tmp_path / "merged"
    assert main(["export", str(output_dir), str(merged), "--merge-lora"]) == 0
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert (merged / "processor_config.json").is_file()
    capsys.readouterr()
    image = drawn(tmp_path, "circle", "red", 3)
    assert main(["chat", str(merged), "--image", str(image), "--prompt", "What shape is this?"]) == 0
    assert capsys.readouterr().out.strip() == "circle"
    assert main(["export", str(merged), str(tmp_path / "gguf"), "--gguf"]) == 2
    assert "finetune: error: --gguf: Qwen2VLForConditionalGeneration is a vision-language model" in \
        capsys.readouterr().err
    assert not any((tmp_path / "gguf").glob("*.gguf"))


# --- the peers' data formats, in one process ---------------------------------------------------------------------

def peer_rows(folder) -> dict[str, list[dict]]:
    """A few rows in each peer's documented schema, their images as files beside the data."""
    import random

    rng = random.Random(3)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = {"trl": [], "llamafactory": [], "axolotl": []}
    for index in range(8):
        shape, colour = rng.choice(synthetic.SHAPES), rng.choice(list(synthetic.COLOURS))
        name = f"images/{index}.png"
        synthetic.draw(shape, colour, 32, rng).save(folder / name)
        # TRL (and the alignment handbook): content parts, the images in an `images` column
        rows["trl"].append({"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": shape}]}], "images": [name]})
        # LLaMA-Factory's sharegpt-style multimodal data: `<image>` markers in the text, `images` paths
        rows["llamafactory"].append({"messages": [
            {"role": "user", "content": "<image>What shape is this?"},
            {"role": "assistant", "content": shape}], "images": [name]})
        # axolotl's multimodal chat template: each image given inside its part (`path`)
        rows["axolotl"].append({"messages": [
            {"role": "user", "content": [{"type": "image", "path": name}, {"type": "text", "text": "What shape?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": shape}]}]})
    return rows


@pytest.mark.parametrize("peer", ["trl", "llamafactory", "axolotl"])
def test_the_peers_formats_load_and_train(peer, tmp_path):
    from finetune.recipe.parse import parse_recipe
    from finetune.train.run import train

    data = tmp_path / "data"
    rows = peer_rows(data)[peer]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    output_dir = tmp_path / "run"
    recipe = parse_recipe("recipes/vision.yaml", [
        "--dataset", str(data / "train.jsonl"), "--output_dir", str(output_dir), "--strategy", "single",
        "--max_steps", "3", "--per_device_train_batch_size", "4", "--eval_on_start", "false", "--logging_steps", "1",
        "--report_to", "none", "--disable_tqdm", "true"])
    summary = train(recipe)
    assert summary["train_loss"] > 0
    data_summary = json.loads((output_dir / "data_summary.json").read_text())
    train_split = data_summary["sources"][0]["train"]
    assert train_split["rows_kept"] == 8 and train_split["image_tokens"]["total"] == 8 * 4
    assert train_split["labelled_tokens"] > 0
    assert (output_dir / "processor_config.json").is_file()


def test_a_bad_row_stops_training_in_one_line_naming_it(tmp_path):
    from finetune.recipe.parse import parse_recipe
    from finetune.train.run import train

    data = tmp_path / "data"
    rows = peer_rows(data)["trl"]
    rows[4]["images"] = ["images/nowhere.png"]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = parse_recipe("recipes/vision.yaml", ["--dataset", str(data / "train.jsonl"), "--output_dir",
                                                  str(tmp_path / "run"), "--strategy", "single"])
    with pytest.raises(RecipeError, match=r"^train example 5: image `images/nowhere\.png` does not exist \(relative "
                                          r"to .*data\)\.$") as refused:
        train(recipe)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run" / "model.safetensors").exists()


# --- the encoder's length rules and the plan's image tokens --------------------------------------------------------

def test_an_image_is_never_cut_rows_whose_images_end_past_the_limit_follow_overlong_policy(processor):
    from finetune.data.vision.pipeline import VisionEncoder

    image = Image.new("RGB", (64, 64), (40, 70, 220))  # 16 image tokens
    row = {"messages": ONE_IMAGE, "images": [image]}
    whole = VisionEncoder("train", processor, DataArguments(max_seq_length=512), None)(row, 0)
    assert whole["drop"] == "" and whole["image_tokens"] == 16
    for policy in ("truncate", "drop"):
        cut = VisionEncoder("train", processor, DataArguments(max_seq_length=12, overlong_policy=policy), None)
        assert cut(row, 0)["drop"] == "overlong" and cut(row, 0)["input_ids"] == []
    refusing = VisionEncoder("train", processor, DataArguments(max_seq_length=12, overlong_policy="error"), None)
    with pytest.raises(RecipeError, match=r"^train example 1 has \d+ tokens, its images ending at token \d+, more than "
                                          r"`max_seq_length: 12`"):
        refusing(row, 0)
    # past the images: truncated as text is, the image whole
    tail = VisionEncoder("train", processor, DataArguments(max_seq_length=len(whole["input_ids"]) - 2), None)(row, 0)
    assert tail["drop"] == "" and tail["image_tokens"] == 16
    assert tail["input_ids"] == whole["input_ids"][:-2]


@pytest.mark.parametrize("key", ["packing", "padding_free", "streaming"])
def test_packing_padding_free_and_streaming_are_refused_with_the_reason(key):
    from finetune.data.vision.pipeline import check_vision_data_options

    with pytest.raises(RecipeError, match=f"`{key}: true` with a vision-language model"):
        check_vision_data_options(DataArguments(**{key: True}))


def test_the_plans_image_tokens_equal_the_processors_for_five_sizes(processor):
    sizes = [(16, 16), (32, 32), (20, 50), (100, 40), (300, 200)]  # the last past max_pixels: resized down
    counts = []
    for height, width in sizes:
        encoded = encode_vision_conversation(ONE_IMAGE, [Image.new("RGB", (width, height), "red")], processor)
        expanded = sum(token == processor.image_token_id for token in encoded["input_ids"])
        assert image_token_count(processor, height, width) == expanded
        counts.append(expanded)
    assert counts == [1, 4, 3, 12, 12]
    from finetune.models.vision.processors import bound_image_sizes

    bounded = build_processor()
    bound_image_sizes(bounded, None, 32 * 32)  # `max_pixels`: fewer tokens for the large image
    encoded = encode_vision_conversation(ONE_IMAGE, [Image.new("RGB", (200, 300), "red")], bounded)
    assert image_token_count(bounded, 300, 200) == sum(token == bounded.image_token_id
                                                       for token in encoded["input_ids"]) < 12
    with pytest.raises(RecipeError, match="`min_pixels: 4096` is more than `max_pixels: 1024`"):
        bound_image_sizes(bounded, 64 * 64, 32 * 32)


def test_vision_keys_on_a_text_model_are_refused_by_name():
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.args import ModelArguments

    with pytest.raises(RecipeError, match=r"^`max_pixels` is for a vision-language model; tiny reads text only"):
        load_tokenizer(ModelArguments(model_name_or_path="tiny", max_pixels=1024))


def test_the_preprocessed_cache_is_keyed_by_the_image_resize_rules():
    """`max_pixels` changes every image's tokens: a cache written under other bounds is stale, never read."""
    from finetune.data.cache import cache_key
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.args import ModelArguments

    data = DataArguments(dataset="synthetic-shapes")
    keys = [cache_key(data, load_tokenizer(ModelArguments(model_name_or_path="tiny-vl", max_pixels=pixels)), 0)
            for pixels in (None, None, 32 * 32)]
    assert keys[0] == keys[1]
    assert [part for part in keys[0] if keys[0][part] != keys[2][part]] == ["image_processor"]
