"""Generated launch configs: DeepSpeed JSON and Accelerate YAML, written and checked from one place."""

from finetune.configs.accelerate import accelerate_config
from finetune.configs.deepspeed import deepspeed_config

__all__ = ["accelerate_config", "deepspeed_config"]
