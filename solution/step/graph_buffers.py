"""The buffers the decoder CUDA graphs (step/cuda_graphs.py) read and write: the dropout masks (``MaskSlots``),
the inputs, outputs and gradients shared by every bucket (``Arena``), the weights' gradients (``GradBuffers``)."""
from __future__ import annotations

import torch

from solution.kernels.lora_nf4 import draw_padded_mask
from solution.step import packing


class MaskSlots(packing.DropoutMaskSource):
    """The LoRA dropout masks of one step: one bool buffer [capacity, hidden] per dropout call, in call order.
    ``take`` (inside the layers) hands out the first n rows; ``draw`` (before a replay) fills them as stock would."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.specs: list[tuple[float, torch.dtype, int]] = []
        self.buffers: list[torch.Tensor] = []
        self._n = self._i = 0

    def begin(self, n_tokens: int) -> None:
        self._n, self._i = n_tokens, 0

    def calls(self) -> int:
        return self._i

    def take(self, p: float, x: torch.Tensor) -> torch.Tensor:
        i, spec = self._i, (float(p), x.dtype, int(x.shape[-1]))
        self._i += 1
        if x.shape[:-1].numel() != self._n:
            raise RuntimeError(f"dropout input of {x.shape[:-1].numel()} tokens in a graph of {self._n}")
        if i == len(self.specs):
            self.specs.append(spec)
            self.buffers.append(torch.zeros((self.capacity, spec[2]), dtype=torch.bool, device=x.device))
        elif self.specs[i] != spec:
            raise RuntimeError(f"dropout call {i} is {spec}, recorded as {self.specs[i]}")
        return self.buffers[i][: self._n].view(x.shape)

    def pack(self) -> None:
        """Move the masks into one allocation (values not kept: draw() refills them). After the first warm-up,
        which made them between its activations: one live mask keeps its 20 MiB granule mapped through
        empty_cache() (~1 GiB measured: docs/cuda_graphs.md, section 5b)."""
        if not self.buffers:
            return
        sizes = [b.numel() for b in self.buffers]
        flat = torch.zeros(sum(sizes), dtype=torch.bool, device=self.buffers[0].device)
        shapes = [b.shape for b in self.buffers]
        self.buffers = [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]

    def draw(self, info: packing.Unpadded) -> None:
        """Each mask as lora_nf4.lora_dropout draws it eagerly (stock's padded shape: the same random numbers),
        in order, keeping the bucket's tokens' rows (filler rows: copies of real rows')."""
        rows, n = info.batch * info.seqlen, info.n_tokens
        with torch.no_grad():
            for (p, dtype, hidden), buf in zip(self.specs, self.buffers):
                draw_padded_mask(p, (rows, hidden), dtype, info.idx, out=buf[:n])


class Arena:
    """The layers' inputs, outputs, gradients and masks for up to ``capacity`` tokens, shared by a runner's graphs."""

    def __init__(self, capacity: int, h: torch.Tensor, cos: torch.Tensor):
        self.capacity = capacity
        dev, hid = h.device, h.shape[-1]
        self.h = torch.zeros((1, capacity, hid), dtype=h.dtype, device=dev)
        self.out = torch.zeros_like(self.h)
        self.grad_out = torch.zeros_like(self.h)
        self.grad_h = torch.zeros_like(self.h)
        self.cos = torch.zeros((1, capacity, cos.shape[-1]), dtype=cos.dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.pos = torch.zeros((1, capacity), dtype=torch.int64, device=dev)
        self.masks = MaskSlots(capacity)

    def fits(self, h: torch.Tensor, cos: torch.Tensor) -> bool:
        return (h.shape[1] <= self.capacity and h.dtype == self.h.dtype and h.shape[-1] == self.h.shape[-1]
                and cos.dtype == self.cos.dtype and cos.shape[-1] == self.cos.shape[-1])


class GradBuffers:
    """The gradient buffers the backward graphs write: views of one flat buffer when the parameters share a
    dtype and device, so that a replay hands out its copies with one clone (autograd keeps each view as that
    parameter's ``.grad``: the same values and layout as one clone each)."""

    def __init__(self, params: list[torch.Tensor]):
        self.shapes = [p.shape for p in params]
        one_kind = len({(p.dtype, p.device) for p in params}) == 1
        self.flat = (torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
                     if params and one_kind else None)
        self.views = self._views(self.flat) if self.flat is not None else [torch.zeros_like(p) for p in params]

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(flat[at: at + n].view(shape))
            at += n
        return out

    def copies(self, wanted: list[bool]) -> list[torch.Tensor | None]:
        """Copies of the buffers (None where ``wanted`` is False), safe to keep past the next replay."""
        if self.flat is None:
            return [buf.clone() if w else None for buf, w in zip(self.views, wanted)]
        return [v if w else None for v, w in zip(self._views(self.flat.clone()), wanted)]
