"""The training methods, one home each (a module or a folder here), registered in finetune.recipe.methods: each
answers the same questions (`finetune.recipe.methods.Method`) so that `finetune.train.run.train` tells one story for
all."""
