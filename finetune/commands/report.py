"""`finetune report OUTPUT_DIR`: re-render `memory_report.md` and `.png` from `memory_report.json` and print
the table."""

from __future__ import annotations

from pathlib import Path


def report_command_parser(subparsers) -> None:
    parser = subparsers.add_parser("report", help="re-render the memory report of a finished run",
                                   description="Re-render memory_report.md and memory_report.png from "
                                   "OUTPUT_DIR/memory_report.json and print the table.")
    parser.add_argument("output_dir", type=Path, help="a run's output_dir")
    parser.set_defaults(func=report_command)


def report_command(args) -> int:
    from finetune.memory.report import render_memory_report

    paths = render_memory_report(args.output_dir)
    print(paths[0].read_text())
    for path in paths:
        print(f"wrote {path}")
    return 0
