"""`python -m eval.lm_eval ...`: lm-eval's own command line with the `declab` model registered.

lm-eval 0.4.x finds models only in its registry, filled from its own `lm_eval.models` package; it has
no plugin entry point for an external package, so a bare `lm_eval --model declab` cannot see the lab.
This module registers `declab` (by importing `eval.lm_model`) and then runs lm-eval's CLI main with
the same arguments, so every lm-eval option works unchanged:

    python -m eval.lm_eval --model declab \
        --model_args pretrained=llama-tiny,dtype=float32,max_length=512,batch_size=8 \
        --include_path eval/tasks --tasks declab_mqar --limit 50
"""

import eval.lm_model  # noqa: F401  (registers the `declab` model)
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
