"""The toolkit's variants and strategies against a plain Hugging Face Trainer baseline, side by side in one run.

    python benchmarks/bench.py --cpu            # a few minutes on 2 CPU cores
    python benchmarks/bench.py --gpu            # random-init Llama-3.2-1B shape, sequence 2048, bf16

Same as `finetune bench`; writes benchmarks/results/<device>.json.
"""

import sys

from finetune.cli import main

if __name__ == "__main__":
    sys.argv = ["finetune", "bench", *sys.argv[1:]]
    sys.exit(main(sys.argv[1:]))
