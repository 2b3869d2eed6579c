"""Original Triton kernels for Soup's QLoRA fine-tuning.

Public entry points (the challenge calls ``apply()`` in-process before Soup trains):

    import solution
    solution.apply()    # install every patch this environment supports; idempotent
    solution.revert()   # restore the stock transformers / peft / bitsandbytes / trl path exactly
    solution.apply(settings=solution.Settings(memory_policy="memory"))  # instead of $SOLUTION_* (read once)

See README.md and docs/ for what each kernel replaces and how it was measured.
"""
from solution._apply import apply, installed, revert
from solution.settings import Settings

__all__ = ["apply", "revert", "installed", "Settings"]
