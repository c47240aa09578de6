"""The before/after summary (finetune.train.evaluation): 'after' is always the final weights' evaluation, and 'before'
is
only reported when something was evaluated earlier."""

from rich.console import Console

from finetune.train.evaluation import print_before_after, summarize_evaluations

FINAL = {"eval_loss": 1.5}


def test_without_an_earlier_evaluation_there_is_no_before_column():
    history = [{"loss": 3.0, "step": 2}, {"eval_loss": 1.5, "step": 4}]
    summary = summarize_evaluations(history, [], FINAL)
    assert summary == {"after": {"step": 4, "eval_loss": 1.5}}
    console = Console(record=True, width=120)
    print_before_after(summary, console)
    text = " ".join(console.export_text().split())
    assert "After training" in text and "eval_on_start: true adds a 'before' column" in text and "before (" not in text


def test_an_evaluation_on_start_is_the_before_column_and_the_final_one_the_after():
    history = [{"eval_loss": 4.0, "step": 0, "eval_exact_match/reverse": 0.0}, {"loss": 3.0, "step": 2},
               {"eval_loss": 1.6, "step": 4, "eval_exact_match/reverse": 0.5}]
    summary = summarize_evaluations(history, [], FINAL)
    assert summary["before"] == {"step": 0, "eval_loss": 4.0, "exact_match": {"reverse": 0.0}}
    assert summary["after"] == {"step": 4, "eval_loss": 1.5, "exact_match": {"reverse": 0.5}}
    console = Console(record=True, width=120)
    print_before_after(summary, console)
    text = console.export_text()
    assert "before (step 0)" in text and "50.0%" in text


def test_no_final_evaluation_reports_nothing():
    assert summarize_evaluations([{"eval_loss": 4.0, "step": 0}], [], None) == {}
