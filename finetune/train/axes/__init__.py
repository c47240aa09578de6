"""The parallelism axes, one home each (a module or a folder here), registered in finetune.recipe.axes: each answers
the same questions (`finetune.recipe.axes.Axis`) so that `finetune.train.run.train` tells one story whatever takes the
steps."""
