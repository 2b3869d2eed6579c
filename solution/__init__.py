"""Original Triton kernels for Soup's QLoRA fine-tuning (README.md, docs/). The challenge calls ``apply()``
in-process before Soup trains:

    import solution
    solution.apply()    # install every patch this environment supports; idempotent
    solution.revert()   # restore the stock transformers / peft / bitsandbytes / trl path exactly
    solution.apply(settings=solution.Settings(memory_policy="memory"))  # instead of $SOLUTION_* (read once)
"""
from solution._apply import apply, installed, revert
from solution.settings import Settings

__all__ = ["apply", "revert", "installed", "Settings"]
