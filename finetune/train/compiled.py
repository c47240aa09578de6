"""What `torch_compile: true` did in a run: the frames and graphs torch.compile built, the seconds it spent, and each
graph break by its reason, written to `output_dir/compile.json` and said in one line at the end of training.

Trainer hands `torch_compile` (with `torch_compile_backend` and `torch_compile_mode`) to Accelerate, which compiles
the model after wrapping it (DDP, FSDP2) or through DeepSpeed's engine. A graph break splits the model into graphs
run one after the other, with Python in between: the reasons name what dynamo could not trace, the place to look
first when compile brings less than expected. The counts are dynamo's own (`torch._dynamo.utils.counters`), for
this process, from the start of training.
"""

from __future__ import annotations

from collections import Counter

from transformers import TrainerCallback

from finetune import outputs


def graph_break_name(reason: str) -> str:
    """A graph break's reason in one line: dynamo's heading, and its explanation where it gives one."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    heading = lines[0] if lines else "unknown"
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines[1:]
                        if line.startswith("Explanation:")), None)
    return f"{heading}: {explanation}"[:300] if explanation else heading[:300]


def compile_report(backend: str | None, mode: str | None) -> dict:
    """This process's compile counts so far, the graph breaks grouped by reason, most frequent first."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    breaks: Counter = Counter()
    for reason, count in counters["graph_break"].items():
        breaks[graph_break_name(reason)] += count
    seconds = compilation_time_metrics.get("_compile.compile_inner")
    return {"backend": backend or "inductor", "mode": mode or "default",
            "frames_compiled": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(breaks.values()), "graph_break_reasons": dict(breaks.most_common()),
            "compile_seconds": round(sum(seconds), 2) if seconds is not None else None}


def describe(report: dict) -> str:
    breaks = report["graph_breaks"]
    line = (f"torch.compile ({report['backend']}, mode {report['mode']}): {report['graphs']} graph(s) from "
            f"{report['frames_compiled']} frame(s), {breaks} graph break(s)")
    if report["compile_seconds"] is not None:
        line += f", {report['compile_seconds']:.1f} s compiling"
    if breaks:
        line += "; " + "; ".join(f"{count} × {reason.splitlines()[0]}"
                                 for reason, count in list(report["graph_break_reasons"].items())[:3])
    return line


class CompileReportCallback(TrainerCallback):
    """Counts from the start of training (dynamo's counters are cleared then) and reports at its end, on rank 0."""

    def on_train_begin(self, args, state, control, **kwargs):
        from torch._dynamo.utils import compilation_time_metrics, counters

        counters.clear()
        compilation_time_metrics.clear()

    def on_train_end(self, args, state, control, **kwargs):
        report = compile_report(args.torch_compile_backend, args.torch_compile_mode)
        if state.is_world_process_zero:
            outputs.write_record(args.output_dir, outputs.COMPILE, report)
            print(describe(report))
