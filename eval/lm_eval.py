"""`python -m eval.lm_eval ...`: lm-eval's own command line with the `declab` model registered.

lm-eval 0.4.x finds models only in its registry, filled from its own `lm_eval.models` package; it has
no plugin entry point for an external package, so a bare `lm_eval --model declab` cannot see the lab.
This module registers `declab` (by importing `eval.lm_model`) and then runs lm-eval's CLI with the
same arguments, so every lm-eval option works unchanged:

    python -m eval.lm_eval --model declab \
        --model_args pretrained=llama-tiny,dtype=float32,max_length=512,batch_size=8 \
        --include_path eval/tasks --tasks declab_mqar --limit 50

With `--model declab` the model_args are checked before lm-eval indexes its tasks (an unknown preset
or argument, an incomplete checkpoint); these, any preset, checkpoint or option the lab refuses later,
and a task lm-eval does not find are one line on stderr and exit code 2.
"""

import sys

import decoders
import eval.lm_model  # (registers the `declab` model)

# How lm-eval 0.4 words its refusal of a task name (a ValueError, which it leaves to a traceback).
TASKS_NOT_FOUND = "Tasks not found"


def main() -> None:
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    with decoders.user_errors():
        if getattr(args, "model", None) == "declab":
            eval.lm_model.check_model_args(dict(getattr(args, "model_args", None) or {}))
        try:
            parser.execute(args)
        except ValueError as e:
            if not str(e).startswith(TASKS_NOT_FOUND):
                raise
            print(f"error: {e} (the lab's tasks: --include_path eval/tasks after python -m eval.tasks.make)", file=sys.stderr)
            raise SystemExit(2) from None


if __name__ == "__main__":
    main()
