"""``transformers.Trainer.train``: hand the run's row lengths, rows per batch and batch count to
solution/step/lengths.py (CUDA-graph buckets captured ahead), then run stock's ``train`` unchanged. Where the
figures do not describe the batches (iterable dataset, no ``input_ids``, length-grouped sampling,
padding-free or packed batches, several processes) nothing is noted.
"""
from __future__ import annotations

import functools
import math

from solution.step import lengths

NAME = "trainer_lengths"


def check() -> str | None:
    try:
        import transformers
    except Exception as exc:  # noqa: BLE001 - transformers missing or broken
        return f"transformers not importable ({type(exc).__name__}: {exc})"
    if not callable(getattr(transformers.Trainer, "train", None)):
        return "transformers.Trainer has no train()"
    return None


def profile_of(trainer) -> lengths.LengthProfile | None:
    """The trainer's length profile (rows' token counts, batch, batches to run), or None."""
    args = trainer.args
    ds = getattr(trainer, "train_dataset", None)
    if (ds is None or getattr(args, "group_by_length", False) or getattr(trainer, "padding_free", False)
            or getattr(args, "packing", False) or getattr(args, "world_size", 1) != 1):
        return None
    try:
        n_rows = len(ds)
        if n_rows > lengths.MAX_ROWS:
            return None
        column = ds["input_ids"]
        row_lengths = [len(ids) for ids in column]
    except Exception:  # noqa: BLE001 - an iterable dataset, no input_ids column, ...: nothing to note
        return None
    batch = int(args.per_device_train_batch_size)
    if args.max_steps and args.max_steps > 0:
        steps = int(args.max_steps) * int(args.gradient_accumulation_steps)
    else:
        steps = math.ceil(n_rows / batch) * math.ceil(float(args.num_train_epochs))
    return lengths.note(row_lengths, batch, steps, getattr(args, "max_length", None))


def _make_train(stock_train):
    def train(self, *args, **kwargs):
        try:
            profile_of(self)
        except Exception:  # noqa: BLE001 - a prediction is an optimisation: never stop a run over it
            lengths.clear()
        return stock_train(self, *args, **kwargs)

    functools.update_wrapper(train, stock_train)
    return train


def install(swaps) -> str:
    import transformers

    swaps.set(transformers.Trainer, "train", _make_train(transformers.Trainer.train))
    return "Trainer.train notes the dataset's row lengths (read only) to capture CUDA-graph buckets ahead"
