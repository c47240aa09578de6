"""Vision-language fine-tuning: images in the data, the model's own processor in the pipeline.

- `presets`: the embedded tiny vision-language model (Qwen2-VL's architecture at toy widths, random weights) and its
  processor (the tiny tokenizer extended by Qwen2-VL's vision tokens, Qwen2-VL's image processor), built in code.
- `processors`: loading a model's processor; where a processor also handles videos through a backend this machine
  lacks (torchvision), its image-only form, said so once, videos refused by name.
- `encode`: a conversation with images as the model's inputs (`input_ids`, `pixel_values`, the model's extra inputs
  such as `image_grid_thw` and `mm_token_type_ids`) and labels on the assistant's tokens only.
- `collate`: batches of such rows, encoded as each batch is built (no pixels stored with the dataset).
- `data`: rows with images in the peers' formats, read as one conversation shape and RGB images.
- `synthetic`: images drawn in code (coloured shapes) with questions a model can learn to answer.
"""
