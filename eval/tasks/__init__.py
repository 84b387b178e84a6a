"""The lab's offline lm-eval tasks: `python -m eval.tasks.make` writes their data and YAMLs (see make.py)."""
