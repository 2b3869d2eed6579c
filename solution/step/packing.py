"""No work on padding: the real tokens of a right-padded batch as one packed row (why, and what must not
change: docs/no_padding.md).

``Unpadded`` says where the real tokens sit in the padded [batch, seqlen] layout; ``pad_rows`` / ``unpad_rows``
move rows between the two. LoRA dropout keeps stock's random numbers by drawing over the padded shape
(kernels/lora_nf4.py), or takes its masks from a ``DropoutMaskSource`` (``dropout_masks_from``).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Unpadded:
    """Where the N real tokens of a right-padded [batch, seqlen] batch are (tensors on the device).
    idx: int64 [N], flat positions b * seqlen + t, in order; positions: int64 [N], each token's position in
    its row (RoPE's); batch, seqlen: the padded batch's shape (dropout's draws); lengths: real tokens per row
    (host ints); cu_seqlens: int32 [rows + 1], each row's start and N (variable-length attention's offsets);
    max_len_bound: when set, the longest row attention must allow for instead of max(lengths) (a CUDA
    graph's bound for its bucket)."""
    idx: torch.Tensor
    positions: torch.Tensor
    batch: int
    seqlen: int
    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor | None = None
    max_len_bound: int | None = None

    @property
    def n_tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def max_len(self) -> int:
        """The longest row, as attention's grid must cover it (see max_len_bound)."""
        return max(self.lengths) if self.max_len_bound is None else self.max_len_bound


def right_padded_lengths(attention_mask: torch.Tensor) -> list[int] | None:
    """Row lengths when ``attention_mask`` [batch, seqlen] is right padding (ones then zeros), else None; one sync."""
    if attention_mask.dim() != 2 or attention_mask.dtype not in (torch.int64, torch.int32, torch.bool, torch.uint8):
        return None
    m = attention_mask
    lengths = (m != 0).sum(1)
    expected = torch.arange(m.shape[1], device=m.device)[None, :] < lengths[:, None]
    bad = ((m != expected.to(m.dtype)) | ((m != 0) & (m != 1))).any()
    host = torch.cat([lengths, bad.view(1).to(lengths.dtype)]).tolist()
    return None if host[-1] else [int(v) for v in host[:-1]]


def make_unpadded(lengths: list[int], seqlen: int, device: torch.device, extra: int = 0) -> Unpadded:
    """Index tensors for a right-padded batch with these row lengths (built on the host, one copy). ``extra``
    > 0 adds a CUDA-graph bucket's filler row: the first ``extra`` tokens of the longest row (cyclically), at
    positions 0..extra-1 with its own ``cu_seqlens`` entry (it attends only to itself); gathers through ``idx``
    give it real values (finite where those are). ``lengths`` then ends with ``extra``."""
    flat = torch.cat([torch.arange(b * seqlen, b * seqlen + n) for b, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    if extra > 0:
        longest = max(range(len(lengths)), key=lambda b: lengths[b])
        ar = torch.arange(extra)
        flat = torch.cat([flat, longest * seqlen + ar % lengths[longest]])
        pos = torch.cat([pos, ar])
        lengths = list(lengths) + [extra]
    n = flat.numel()
    starts = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)
    packed = torch.cat([flat, pos, starts]).to(device)  # one host-to-device copy
    b = len(lengths) - (extra > 0)  # batch: the padded batch's rows (the draws' shape)
    return Unpadded(idx=packed[:n], positions=packed[n:2 * n], batch=b, seqlen=seqlen, lengths=tuple(lengths),
                    cu_seqlens=packed[2 * n:].to(torch.int32))


class DropoutMaskSource:
    """Where LoRA dropout takes its masks instead of drawing them: ``take(p, x)``, a bool mask shaped like x."""

    def take(self, p: float, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


_MASKS: contextvars.ContextVar[DropoutMaskSource | None] = contextvars.ContextVar("solution_dropout_masks",
                                                                                  default=None)


def dropout_mask_source() -> DropoutMaskSource | None:
    """The mask source set by ``dropout_masks_from`` (None: LoRA dropout draws its own)."""
    return _MASKS.get()


@contextlib.contextmanager
def dropout_masks_from(source: DropoutMaskSource):
    """Within this block LoRA dropout on CUDA takes its masks from ``source`` in call order and draws
    nothing (a CUDA graph's masks, drawn before each replay as stock would: step/cuda_graphs.py)."""
    token = _MASKS.set(source)
    try:
        yield source
    finally:
        _MASKS.reset(token)


def pad_rows(rows: torch.Tensor, info: Unpadded) -> torch.Tensor:
    """[N, ...] real-token rows -> [batch * seqlen, ...] with zeros at pad positions (differentiable)."""
    out = rows.new_zeros((info.batch * info.seqlen,) + tuple(rows.shape[1:]))
    return out.index_copy(0, info.idx, rows)


def unpad_rows(padded: torch.Tensor, info: Unpadded) -> torch.Tensor:
    """[batch * seqlen, ...] -> the [N, ...] rows of the real tokens (differentiable)."""
    return padded.index_select(0, info.idx)
