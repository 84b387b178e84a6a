"""Quality: the lab as an lm-eval model (`eval.lm_model`, registered as `declab`), offline tasks
(`eval/tasks`), training of matched small models (`eval.train`), the quality CLI (`eval.quality`)
and the matched-model ablation (`eval.ablation`). lm-eval is imported only by the modules that need it.
"""
