"""Vision-language conversations as a model's inputs: the processor's expansion of each image, and labels on the
assistant's tokens only (no image token, no prompt token), under the tiny template and a ChatML one as Qwen2-VL's
hub checkpoints ship it."""

import pytest
from hub_fixtures import VL_CHATML as CHATML
from PIL import Image

from finetune.data.tokenize import IGNORE_INDEX
from finetune.data.vision import synthetic
from finetune.data.vision.encode import encode_vision_conversation
from finetune.errors import RecipeError
from finetune.models.vision.presets import build_model, build_processor
from finetune.models.vision.processors import load_processor

TWO_IMAGES_TWO_TURNS = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
    {"role": "assistant", "content": "a blue circle"},
]
IMAGES = [Image.new("RGB", (48, 40), (220, 40, 40)), Image.new("RGB", (64, 64), (40, 70, 220))]


@pytest.fixture(scope="module")
def processor():
    return build_processor()


def chatml(processor):
    processor = build_processor()
    processor.tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    processor.chat_template = processor.tokenizer.chat_template = CHATML
    return processor


@pytest.mark.parametrize("template", ["tiny", "chatml"])
def test_no_image_or_prompt_token_is_learned_and_every_assistant_token_is(processor, template):
    processor = chatml(processor) if template == "chatml" else processor
    tokenizer = processor.tokenizer
    encoded = encode_vision_conversation(TWO_IMAGES_TWO_TURNS, IMAGES, processor)
    ids, labels, kinds = encoded["input_ids"], encoded["labels"], encoded["mm_token_type_ids"]
    learned = [position for position, label in enumerate(labels) if label != IGNORE_INDEX]
    assert all(labels[position] == ids[position] for position in learned)
    # each answer and the special token closing its turn, nothing else
    closer = tokenizer.eos_token if template == "tiny" else "<|im_end|>"
    answers = [tokenizer(text + closer, add_special_tokens=False)["input_ids"] for text in ("red", "a blue circle")]
    runs, run = [], []
    for position in learned:
        if run and position != run[-1] + 1:
            runs.append(run)
            run = []
        run.append(position)
    runs.append(run)
    assert [[ids[position] for position in run] for run in runs] == answers
    # every image token is an image's, expanded as the processor counts them, and none is learned
    image_id = processor.image_token_id
    image_positions = [position for position, token in enumerate(ids) if token == image_id]
    counts = processor._get_num_multimodal_tokens(image_sizes=[(image.height, image.width) for image in IMAGES])
    assert len(image_positions) == sum(counts.num_image_tokens) == 6 + 16
    assert [position for position, kind in enumerate(kinds) if kind] == image_positions
    assert not set(image_positions) & set(learned)
    # the user's text is in the input and not learned
    prompt_text = tokenizer.decode([ids[position] for position in range(len(ids)) if position not in learned])
    assert "What colour is it?" in prompt_text and "And this one?" in prompt_text
    assert encoded["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8]]  # 40 × 48 → 32 × 48 pixels; 64 × 64


@pytest.mark.parametrize("side", [16, 24, 40, 64, 100])
def test_each_image_is_expanded_into_the_tokens_the_processor_counts_for_its_size(processor, side):
    image = Image.new("RGB", (side, side + 8))
    encoded = encode_vision_conversation(TWO_IMAGES_TWO_TURNS[:2], [image], processor)
    expected = processor._get_num_multimodal_tokens(image_sizes=[(side + 8, side)]).num_image_tokens
    assert encoded["input_ids"].count(processor.image_token_id) == expected[0] >= 1


def test_a_marker_count_that_differs_from_the_image_count_is_one_line(processor):
    with pytest.raises(RecipeError, match=r"2 image part\(s\) and 1 image\(s\)"):
        encode_vision_conversation(TWO_IMAGES_TWO_TURNS, IMAGES[:1], processor)


def test_a_saved_processor_loads_back_and_encodes_alike_without_torchvision(processor, tmp_path, capsys):
    processor.save_pretrained(tmp_path)
    loaded = load_processor(str(tmp_path))
    assert type(loaded).__name__ == "Qwen2VLProcessor"
    again = encode_vision_conversation(TWO_IMAGES_TWO_TURNS, IMAGES, loaded)
    first = encode_vision_conversation(TWO_IMAGES_TWO_TURNS, IMAGES, processor)
    assert again["input_ids"] == first["input_ids"] and again["labels"] == first["labels"]
    assert (again["pixel_values"] == first["pixel_values"]).all()
    try:
        import torchvision  # noqa: F401
    except ImportError:
        assert "needs torchvision, which is not installed): reading images only" in capsys.readouterr().err
        with pytest.raises(ValueError, match="videos cannot be read here"):
            loaded(text=["x"], videos=[[IMAGES[0]]])


def test_the_tiny_model_trains_its_vision_tower_on_encoded_rows(processor):
    import torch

    model = build_model(processor)
    row = synthetic.rows(1, seed=3)[0]
    encoded = encode_vision_conversation(row["messages"], row["images"], processor)
    inputs = {"input_ids": torch.tensor([encoded["input_ids"]]), "labels": torch.tensor([encoded["labels"]]),
              "mm_token_type_ids": torch.tensor([encoded["mm_token_type_ids"]]),
              "pixel_values": torch.as_tensor(encoded["pixel_values"]),
              "image_grid_thw": torch.as_tensor(encoded["image_grid_thw"])}
    loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss) and 4 < loss.item() < 7  # about ln(vocabulary): random weights
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0  # the image reaches the loss


def test_synthetic_rows_are_seeded_and_answerable():
    first, again, other = synthetic.rows(12, seed=1), synthetic.rows(12, seed=1), synthetic.rows(12, seed=2)
    assert [row["messages"] for row in first] == [row["messages"] for row in again]
    assert all(a["images"][0].tobytes() == b["images"][0].tobytes() for a, b in zip(first, again))
    assert any(a["images"][0].tobytes() != b["images"][0].tobytes() for a, b in zip(first, other))
    for row in first:
        answer = row["messages"][1]["content"][0]["text"]
        question = row["messages"][0]["content"][1]["text"]
        assert answer in (synthetic.COLOURS if "colour" in question else synthetic.SHAPES)
        pixels = set(row["images"][0].getdata())
        if "colour" in question:
            assert synthetic.COLOURS[answer] in pixels  # the asked colour is drawn


def test_the_collator_pads_tokens_and_computes_each_rows_pixels_in_row_order(processor):
    import torch

    from finetune.data.vision.collate import VisionCollator
    from finetune.data.vision.pipeline import VisionEncoder
    from finetune.recipe.args import DataArguments

    encoder = VisionEncoder("train", processor, DataArguments(max_seq_length=512), None)
    rows = [encoder({"messages": TWO_IMAGES_TWO_TURNS, "images": IMAGES}, 0), encoder(synthetic.rows(1, seed=5)[0], 1)]
    assert all(isinstance(image, dict) and image["bytes"] for row in rows for image in row["images"])  # stored
    batch = VisionCollator(processor)(rows)
    alone = [encode_vision_conversation(row["messages"], row["images"], processor)
             for row in ({"messages": TWO_IMAGES_TWO_TURNS, "images": IMAGES}, synthetic.rows(1, seed=5)[0])]
    lengths = [len(row["input_ids"]) for row in alone]
    assert batch["input_ids"].shape == (2, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    short = lengths.index(min(lengths))
    assert (batch["labels"][short, min(lengths):] == IGNORE_INDEX).all()
    assert (batch["input_ids"][short, min(lengths):] == processor.tokenizer.pad_token_id).all()
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8], [1, 4, 4]]  # three images, in row order
    assert torch.equal(batch["pixel_values"], torch.cat([torch.as_tensor(row["pixel_values"]) for row in alone]))
    model = build_model(processor)
    assert torch.isfinite(model(**batch).loss)
