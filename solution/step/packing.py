"""No work on padding: the real tokens of a right-padded batch as one packed row.

trl pads every batch on the right to its longest row (4 rows, up to 512 tokens each). Every
per-token op of the decoder (projections, LoRA, norms, RoPE, SwiGLU, the LM head) does the same
work on a pad position as on a real one, and the result is thrown away: with right padding and
causal attention a pad position never influences a real one (a real query at position t only
sees keys 0..t, all real), and the loss ignores pad labels (-100).

``Unpadded`` describes where the real tokens sit in the padded [batch, seqlen] layout. The
Qwen2 patch (solution/patches/qwen2_unpad.py) gathers the real tokens into one row [1, N, H],
runs the decoder layers on it, and only the attention goes back to the padded layout (the
attention kernel needs rectangular [batch, heads, seqlen, dim] tensors); the final hidden states
are scattered back to [batch, seqlen, H] with zeros at pad positions.

What must not change, and how it is kept:
- The values of every real position: per-token ops are row-independent; attention sees the same
  keys (causal mask, ``is_causal=True`` instead of the stock boolean padding+causal mask: the
  masked entries are excluded either way); RoPE positions are each row's own 0..len-1.
- The random numbers of LoRA's dropout: torch draws a dropout mask over the tensor it is given,
  so a packed [1, N, H] input would draw other bits (and move the RNG offset by another amount)
  than stock's [batch, seqlen, H]. LoRA's dropout (solution/kernels/lora_nf4.py, given the packed
  batch by the decoder-layer node) draws over the padded shape, exactly as stock does (its
  ``padded_draw_shape``), and keeps the rows of the real tokens.
- The loss, metrics and Soup's per-token outputs: pad positions are ignored by all of them (loss
  and accuracy: label -100; entropy: multiplied by attention_mask 0).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Unpadded:
    """Where the N real tokens of a right-padded [batch, seqlen] batch are.

    idx: int64 [N] on the device, flat positions b * seqlen + t of the real tokens, in order.
    positions: int64 [N] on the device, each token's position in its row (RoPE's position id).
    src: int64 [batch * seqlen] on the device, the packed index of each padded position's token,
    -1 at pad positions (the inverse of idx).
    lengths: real tokens per row (host ints).
    arange: int64 [N] on the device, 0..N-1 (the packed rows' own order).
    cu_seqlens: int32 [batch + 1] on the device, where each row starts among the packed tokens and
    N at the end (the row offsets of variable-length attention).
    max_len_bound: when set, the longest row attention must allow for (``max_len``) instead of
    max(lengths): a batch replayed from a CUDA graph (solution/step/cuda_graphs.py) keeps the
    capture's host values, so it gives a bound that holds for every batch of its bucket."""
    idx: torch.Tensor
    positions: torch.Tensor
    src: torch.Tensor
    batch: int
    seqlen: int
    lengths: tuple[int, ...]
    arange: torch.Tensor | None = None
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
    """Row lengths when ``attention_mask`` [batch, seqlen] is right padding (each row: ones then
    zeros, no other values), else None. One device-to-host copy."""
    if attention_mask.dim() != 2 or attention_mask.dtype not in (torch.int64, torch.int32, torch.bool, torch.uint8):
        return None
    m = attention_mask
    lengths = (m != 0).sum(1)
    expected = torch.arange(m.shape[1], device=m.device)[None, :] < lengths[:, None]
    bad = ((m != expected.to(m.dtype)) | ((m != 0) & (m != 1))).any()
    host = torch.cat([lengths, bad.view(1).to(lengths.dtype)]).tolist()
    return None if host[-1] else [int(v) for v in host[:-1]]


def make_unpadded(lengths: list[int], seqlen: int, device: torch.device, extra: int = 0) -> Unpadded:
    """Index tensors for a right-padded batch with these row lengths (built on the host, one copy).

    ``extra`` > 0 adds one more packed row of that many tokens after the real ones (a CUDA-graph
    bucket's filler, solution/step/cuda_graphs.py): copies of the first ``extra`` tokens of the
    longest real row (cyclically when it is shorter), at positions 0..extra-1 and with its own
    ``cu_seqlens`` entry, so that it attends only to itself. Its tokens are taken from real
    positions, so ``idx`` (and every gather through it: token ids, dropout masks) gives them real
    values and they compute what that row's first tokens compute: finite whenever those are.
    ``lengths`` then ends with ``extra``; ``src`` still maps each padded position to its real token
    (the filler is nobody's)."""
    flat = torch.cat([torch.arange(b * seqlen, b * seqlen + n) for b, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    src = torch.full((len(lengths) * seqlen,), -1, dtype=torch.int64)
    src[flat] = torch.arange(flat.numel())
    if extra > 0:
        longest = max(range(len(lengths)), key=lambda b: lengths[b])
        ar = torch.arange(extra)
        flat = torch.cat([flat, longest * seqlen + ar % lengths[longest]])
        pos = torch.cat([pos, ar])
        lengths = list(lengths) + [extra]
    n = flat.numel()
    starts = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)
    packed = torch.cat([flat, pos, src, torch.arange(n), starts]).to(device)  # one host-to-device copy
    b, m = len(lengths) - (extra > 0), src.numel()  # batch: the padded batch's rows (the draws' shape)
    return Unpadded(idx=packed[:n], positions=packed[n:2 * n], src=packed[2 * n:2 * n + m], batch=b,
                    seqlen=seqlen, lengths=tuple(lengths), arange=packed[2 * n + m:3 * n + m],
                    cu_seqlens=packed[3 * n + m:].to(torch.int32))


class DropoutMaskSource:
    """Where LoRA dropout takes its masks instead of drawing them (see ``dropout_masks_from``):
    ``take(p, x)`` returns a bool mask shaped like x, filled by whoever owns the source."""

    def take(self, p: float, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


_MASKS: contextvars.ContextVar[DropoutMaskSource | None] = contextvars.ContextVar("solution_dropout_masks",
                                                                                  default=None)


def dropout_mask_source() -> DropoutMaskSource | None:
    """The mask source set by ``dropout_masks_from`` (None: LoRA dropout draws its own)."""
    return _MASKS.get()


@contextlib.contextmanager
def dropout_masks_from(source: DropoutMaskSource):
    """Within this block, LoRA dropout on CUDA (solution/kernels/lora_nf4.lora_dropout) takes its
    masks from ``source``, in call order, and draws nothing: a CUDA graph cannot redraw stock's
    masks (their shape changes every step), so the graph runner draws them before each replay
    exactly as stock would and the captured layers read them (solution/step/cuda_graphs.py)."""
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
