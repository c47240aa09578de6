"""The parallelism axes, one home each (a module or a folder here), registered in finetune.axes: each answers
the same questions (`finetune.axes.Axis`) so that `finetune.train.run.train` tells one story whatever takes the
steps."""
