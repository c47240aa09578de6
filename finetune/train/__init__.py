"""The run: the story (`run.train`: recipe → Trainer → results), the Trainer seam (`trainer`: the loss, the checkpoint
guarantees as a mixin), one file per training method (`methods/`), what runs against what was asked (`effective`),
what a W&B or MLflow run holds beyond Trainer's logs (`tracking`), evaluation, throughput and the divergence stop.

`train` is imported when first used, so that reading a recipe (which names its method) loads no trainer."""


def __getattr__(name: str):
    if name == "train":
        from finetune.train.run import train

        return train
    raise AttributeError(f"module 'finetune.train' has no attribute {name!r}")
