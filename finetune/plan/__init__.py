"""Planning before spending GPU hours: the decision tree over strategies (`decision_tree`), a plan from the user's
recipe and data (`from_recipe`), and a finished run's report against its prediction (`calibration`)."""

from finetune.plan.decision_tree import PlanRequest, decision_path, make_plan

__all__ = ["PlanRequest", "decision_path", "make_plan"]
