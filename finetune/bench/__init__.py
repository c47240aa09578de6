"""The benchmark harness behind `finetune bench` and benchmarks/bench.py: a plain Trainer baseline and the
toolkit's variants, run side by side on the same model, data and sequence length."""
