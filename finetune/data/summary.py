"""The data summary: rows, tokens, length percentiles, truncated and dropped rows per source and split,
printed by rank 0 at start and written to `output_dir/data_summary.json`; and the fingerprint of the training rows
that a checkpoint records, so a resume can tell the data changed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from finetune import outputs


def trained_as_plain_text(summary: dict) -> bool:
    """Whether a run learned every source without a chat template: prompt/completion and text examples
    (finetune.data.tokenize.encode_example), and preference pairs of plain strings (TRL renders only conversational
    pairs with the template; finetune.data.pairs records which). False without sources (a hub model's record)."""
    from finetune.data.formats import CONVERSATION_FORMATS, FORMAT_COLUMNS

    plain = set(FORMAT_COLUMNS) - set(CONVERSATION_FORMATS)
    sources = summary.get("sources", [])
    return bool(sources) and all(source.get("format") in plain or source.get("plain_text") for source in sources)


def write_data_summary(summary: dict, output_dir: str) -> Path:
    return outputs.write_record(output_dir, outputs.DATA_SUMMARY, summary)


def fingerprint(dataset) -> str:
    """`<rows> rows, sha256 <digest>` of the tokens and labels training reads, in dataset order (the sampler
    shuffles with the seed): equal exactly when Trainer would see the same rows. Hashes the Arrow values, so a
    million rows of 512 tokens take about a second."""
    digest = hashlib.sha256()
    columns = [name for name in ("input_ids", "labels", "seq_lengths") if name in dataset.column_names]
    if not columns:  # preference pairs (finetune.data.pairs), which TRL tokenizes later: their text
        for row in dataset:
            digest.update(json.dumps(row, sort_keys=True, default=str).encode())
        return f"{len(dataset)} rows, sha256 {digest.hexdigest()[:16]}"
    for batch in dataset.with_format("arrow").iter(batch_size=8192):
        for name in columns:
            column = batch.column(name).combine_chunks()
            digest.update(column.value_lengths().to_numpy(zero_copy_only=False).tobytes())
            digest.update(column.flatten().to_numpy(zero_copy_only=False).tobytes())
    return f"{len(dataset)} rows, sha256 {digest.hexdigest()[:16]}"


def dropped_rows(summary: dict) -> dict[str, int]:
    """Rows dropped per split, over every source."""
    totals: dict[str, int] = {}
    for source in summary["sources"]:
        for split in ("train", "eval"):
            if source[split] is not None:
                totals[split] = totals.get(split, 0) + sum(source[split]["dropped"].values())
    return totals


def print_data_summary(summary: dict) -> None:
    table = Table(title="Data")
    for column in ("source", "split", "format", "rows", "kept", "tokens", "length p50/p90/p99/max", "truncated",
                   "dropped"):
        table.add_column(column, justify="left" if column in ("source", "split", "format", "dropped") else "right")
    for source in summary["sources"]:
        for split in ("train", "eval"):
            stats = source[split]
            if stats is None:
                continue
            lengths = stats["length_percentiles"]
            dropped = ", ".join(f"{count} {reason.replace('_', ' ')}" for reason, count in stats["dropped"].items())
            table.add_row(source["name"], split, source["format"], f"{stats['rows']:,}", f"{stats['rows_kept']:,}",
                          f"{stats['tokens']:,}",
                          f"{lengths['p50']}/{lengths['p90']}/{lengths['p99']}/{lengths['max']}",
                          f"{stats['truncated_rows']:,}", dropped or "–")
    console = Console()
    console.print(table)
    if summary.get("streaming"):
        stream = summary["streaming"]
        console.print(f"Streamed: the train row above describes the first {stream['sampled_rows']:,} examples of the "
                      f"stream (split {stream['split']}); it is tokenized{' and packed' if stream['packing'] else ''} "
                      "as training reads it, each process reading its own rows.")
    if summary["weights"]:
        mix = ", ".join(f"{s['name']} {w:.0%}" for s, w in zip(summary["sources"], summary["weights"]))
        console.print(f"Mixed: {mix} → {summary['train_rows']:,} training rows.")
    for split, packing in summary.get("packing", {}).items():
        console.print(f"Packed {split}: {packing['examples']:,} examples → {packing['rows']:,} rows of up to "
                      f"{packing['row_length']} tokens, {packing['fill']:.1%} filled.")
