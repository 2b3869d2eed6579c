"""``Qwen2DecoderLayer.forward`` with the residual add + post-attention RMSNorm fused
(solution/kernels/add_rmsnorm.py).

Stock (transformers 5.17.0) runs, after self-attention,
``hidden_states = residual + hidden_states; residual = hidden_states;
hidden_states = self.post_attention_layernorm(hidden_states)``. The replacement is a mirror of the
stock body in which those three lines become one ``add_rmsnorm(residual, attn_out, weight, eps)``
call returning both h (the new residual) and the normalized h, when

  * the tensors are CUDA tensors or where our kernels run (the CPU while Triton's interpreter is
    on: solution/kernels/_device.py), the rule of solution/patches/qwen2_rmsnorm.py, and ``add_rmsnorm_supported`` accepts them
    (fp16/fp32, same shapes, hidden <= 8192);
  * ``post_attention_layernorm`` is exactly a Qwen2RMSNorm whose class forward is the stock one
    (the formula checked by qwen2_rmsnorm's check) or our qwen2_rmsnorm replacement of it, with
    no instance-level forward and no module hooks (stock would call the module and fire them);

and runs the stock lines otherwise. ``input_layernorm``, ``self_attn`` and ``mlp`` are called as
modules exactly as stock calls them (their own patches and hooks still apply). Any leading shape
works ([B, S, H], or the [1, N, H] packed rows of qwen2_unpad).

Autocast: stock's add is not on autocast's lists and the norm's ops see fp32 (or explicitly cast)
inputs, so stock's dtypes do not depend on autocast; the fused Function reproduces them
(h in promote(residual, attn_out), y in promote(h, weight)).

Gradient checkpointing: from transformers 5.23 the stock class forward is a
``forward_with_checkpointing`` wrapper around the body (made when the class is created); the
mirror is installed under the same wrapper, made by transformers itself (``_checkpointing_wrapped``),
so a checkpointed layer still runs inside its checkpoint. Up to 5.22 ``__call__`` checkpoints and
the mirror replaces the plain body.

Refused (check()) unless the installed ``Qwen2DecoderLayer.forward`` is one of the reviewed sources
(sha256, solution/patches/_sources.py: transformers 5.16.1-5.23.0) and Qwen2RMSNorm's stock forward has the formula the kernel
implements.
"""
from __future__ import annotations

import functools

import torch

from solution.hooks import has_hooks
from solution.kernels._device import cuda_or_runs_here
from solution.patches._sources import checkpointing_body, unexpected_source

NAME = "qwen2_decoder_layer"


def _stock_norm_forward(norm_cls):
    """Qwen2RMSNorm's stock forward, also when qwen2_rmsnorm's replacement is installed."""
    forward = norm_cls.__dict__.get("forward")
    return getattr(forward, "_solution_stock", forward)


def check() -> str | None:
    try:
        from transformers.models.qwen2 import modeling_qwen2
    except Exception as exc:  # noqa: BLE001 - transformers missing or broken
        return f"transformers' Qwen2 is not importable ({type(exc).__name__}: {exc})"
    layer_cls = getattr(modeling_qwen2, "Qwen2DecoderLayer", None)
    norm_cls = getattr(modeling_qwen2, "Qwen2RMSNorm", None)
    if layer_cls is None or norm_cls is None or "forward" not in layer_cls.__dict__:
        return "transformers has no Qwen2DecoderLayer.forward / Qwen2RMSNorm (another transformers version?)"
    reason = unexpected_source("transformers.Qwen2DecoderLayer.forward", layer_cls.forward)
    if reason is not None:
        return reason
    from solution.patches.qwen2_rmsnorm import _stock_forward_is_expected

    reason = _stock_forward_is_expected(_stock_norm_forward(norm_cls))
    if reason is not None:
        return reason
    try:
        import solution.kernels.add_rmsnorm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"add_rmsnorm kernel not importable ({type(exc).__name__}: {exc})"
    return None


def make_forward(stock_forward, norm_cls, stock_norm_forward):
    """Our Qwen2DecoderLayer.forward body. ``stock_forward``: the body mirrored below;
    ``stock_norm_forward``: Qwen2RMSNorm's stock forward (its formula checked by check())."""
    from solution.kernels import fp32_add
    from solution.kernels.add_rmsnorm import add_rmsnorm, add_rmsnorm_supported

    def fusable(norm, residual, attn_out) -> bool:
        if type(norm) is not norm_cls or "forward" in norm.__dict__ or has_hooks(norm):
            return False
        cls_forward = norm_cls.forward
        if stock_norm_forward not in (cls_forward, getattr(cls_forward, "_solution_stock", None)):
            return False  # someone else replaced Qwen2RMSNorm.forward: call the module
        return cuda_or_runs_here(residual.device) and add_rmsnorm_supported(residual, attn_out, norm.weight)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        position_ids=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ) -> torch.Tensor:
        # The KV cache argument (``past_key_values`` up to transformers 5.23, ``cache`` from 5.24)
        # travels in kwargs, under whichever name the caller used, to self_attn as stock passes it.
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        norm = self.post_attention_layernorm
        if fusable(norm, residual, hidden_states):
            # residual + attention output, and the norm of it, in one kernel (both are needed)
            residual, hidden_states = add_rmsnorm(residual, hidden_states, norm.weight, norm.variance_epsilon)
        else:
            hidden_states = residual + hidden_states
            # Fully Connected
            residual = hidden_states
            hidden_states = norm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if hidden_states.dtype != residual.dtype:
            # the fused NF4 MLP's fp16 output: one Triton pass instead of torch's mixed-dtype add
            return fp32_add.residual_add(residual, hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states

    functools.update_wrapper(forward, stock_forward)
    return forward


def _checkpointing_wrapped(layer_cls, body):
    """``body`` under transformers' own checkpointing wrapper, as the stock forward is from 5.23:
    ``GradientCheckpointingLayer.__init_subclass__`` wraps a subclass's ``forward`` when the class
    is created (a plain assignment later gets no wrapper, and the layer would then run outside the
    checkpoint: the same values, more memory), so a throwaway subclass whose forward is ``body``
    has transformers make it. The wrapper runs ``body`` under the layer's checkpoint function while
    checkpointing is on in training with gradients, else calls it directly (its "outermost" test
    holds once it is Qwen2DecoderLayer's own forward)."""
    sub = type(layer_cls.__name__, (layer_cls,), {"forward": body, "__module__": __name__})
    wrapped = sub.__dict__["forward"]
    if checkpointing_body(wrapped) is not body:
        raise RuntimeError("transformers did not wrap the subclass's forward for checkpointing")
    return wrapped


def install(swaps) -> str:
    from transformers.models.qwen2 import modeling_qwen2

    layer_cls, norm_cls = modeling_qwen2.Qwen2DecoderLayer, modeling_qwen2.Qwen2RMSNorm
    stock = layer_cls.__dict__["forward"]
    body = checkpointing_body(stock)
    forward = make_forward(stock if body is None else body, norm_cls, _stock_norm_forward(norm_cls))
    if body is not None:
        forward = _checkpointing_wrapped(layer_cls, forward)
    forward._solution_stock = stock  # the class attribute replaced (the wrapper from 5.23)
    swaps.set(layer_cls, "forward", forward)
    return ("Qwen2DecoderLayer.forward: residual + attention output and post_attention_layernorm in one "
            "Triton kernel (backward: one kernel); stock ops for anything unsupported")
