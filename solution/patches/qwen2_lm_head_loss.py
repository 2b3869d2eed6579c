"""Wire the fused LM head + loss (solution/kernels/lm_head_loss.py) into Qwen2 + trl's SFTTrainer: two mirrors
of stock code, fused where marked.

1. ``Qwen2ForCausalLM.forward``: when the compute_loss below asks (a context variable) and the call is
   supported (``_head_ok``, ``_compute_dtype``), loss, per-token loss, entropy and argmax come from the fused
   kernel, with ``logits=None``; any other call (generation, eval, logits wanted, bf16...) runs stock's.
2. ``SFTTrainer.compute_loss`` (trl 0.29.1, training cases: ``_trainer_can_fuse``; else stock): sets that
   request, calls ``Trainer.compute_loss`` and logs trl's metrics with trl's formulas, reading entropy and
   argmax from the outputs (from the logits where the forward declined).
Why both: trl reads ``outputs.logits`` for its metrics and crashes without them unless ``use_liger_kernel``,
which we must not require. Soup's rewind recorder, without logits, reads per-row losses from the trainer
attribute ``soup_step_attr()``: a ``FusedLMHeadStep`` after each fused step, None after any other call.
Refused (check()) unless the mirrored sources are reviewed ones (sha256, solution/patches/_sources.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch

from solution.kernels._device import runs_here
from solution.say import say_once
from solution.patches._sources import cache_given, cache_kwarg, drop_cache_args

NAME = "qwen2_lm_head_loss"


# set by the patched compute_loss around its model call ("no logits needed"); other callers get stock's outputs
_FUSED_REQUESTED: contextvars.ContextVar[bool] = contextvars.ContextVar("lm_head_loss_requested", default=False)


@contextlib.contextmanager
def fused_lm_head_requested():
    """Within this block a supported forward with labels returns the token stats and logits=None."""
    token = _FUSED_REQUESTED.set(True)
    try:
        yield
    finally:
        _FUSED_REQUESTED.reset(token)


# Where Soup's rewind recorder looks for per-token losses when the outputs carry no logits.
_DEFAULT_STEP_ATTR = "_soup_chunked_step"


@functools.lru_cache(maxsize=None)
def soup_step_attr() -> str:
    """Soup's STEP_ATTR (soup_cli.utils.stream_loss_chunk) when Soup is installed, else its 0.77 value."""
    try:
        from soup_cli.utils.stream_loss_chunk import STEP_ATTR
    except Exception:  # noqa: BLE001 - Soup absent or changed: the attribute name it used in 0.77
        return _DEFAULT_STEP_ATTR
    return STEP_ATTR if isinstance(STEP_ATTR, str) else _DEFAULT_STEP_ATTR


@dataclass(frozen=True)
class FusedLMHeadStep:
    """What a fused step leaves on the trainer under soup_step_attr(), the fields of Soup's ChunkedStep:
    token_entropy, token_loss fp32 [B, T] (t: cross-entropy of labels[:, t + 1], 0.0 where -100 and at the
    end); correct / labelled: int64 scalars, labelled positions whose argmax is the label / all of them."""
    token_entropy: torch.Tensor
    token_loss: torch.Tensor
    correct: torch.Tensor
    labelled: torch.Tensor


@functools.lru_cache(maxsize=None)
def _output_class():
    """Defined once (ModelOutput subclasses register themselves as pytree nodes)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclass
    class CausalLMOutputWithTokenStats(CausalLMOutputWithPast):
        """CausalLMOutputWithPast with logits=None plus, per [batch, seq] position, token_entropy fp32 (of
        softmax(logits)), token_argmax int64 and token_loss fp32 (against labels[:, t + 1], 0 where ignored)."""
        token_entropy: torch.FloatTensor | None = None
        token_argmax: torch.LongTensor | None = None
        token_loss: torch.FloatTensor | None = None

    CausalLMOutputWithTokenStats.__qualname__ = "CausalLMOutputWithTokenStats"
    return CausalLMOutputWithTokenStats


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype stock's lm_head matmul runs in, if our kernel handles it, else None."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and hidden.dtype in (torch.float32, torch.float16, torch.bfloat16):
        dtype = torch.get_autocast_dtype(dev)  # F.linear is on autocast's lower-precision list
    elif hidden.dtype == weight.dtype:
        dtype = hidden.dtype
    else:
        return None  # stock would raise a dtype mismatch: let it
    return dtype if dtype in (torch.float16, torch.float32) else None  # bf16 etc.: stock


def _head_ok(model, labels, logits_to_keep, kwargs) -> bool:
    """Call-level conditions, checked before running the decoder."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = model.lm_head
    return (labels is not None and _FUSED_REQUESTED.get()
            and isinstance(logits_to_keep, int) and logits_to_keep == 0
            and kwargs.get("shift_labels") is None and kwargs.get("ignore_index", -100) == -100
            and type(head) is torch.nn.Linear and head.bias is None and not head.weight.requires_grad
            and model.loss_function is ForCausalLMLoss
            and head.weight.shape[0] == model.config.vocab_size)


def _packed_lm_head(packed, weight, shift_labels, dtype, num_items_in_batch, labelled_rows):
    """The fused LM head on the packed real-token rows (qwen2_unpad): labels gathered the same way, per-token
    results scattered back to [batch, seqlen] (0 at pads, where stock's values are never used)."""
    from solution.kernels.lm_head_loss import fused_lm_head_loss
    from solution.step.packing import pad_rows, unpad_rows

    hidden, info = packed
    labels = unpad_rows(shift_labels.reshape(-1), info).view(1, -1)
    res = fused_lm_head_loss(hidden, weight, labels, compute_dtype=dtype, num_items_in_batch=num_items_in_batch,
                             cache_weight=True, labelled_rows=labelled_rows)
    shape = (info.batch, info.seqlen)
    per_token = [pad_rows(t.reshape(-1), info).view(shape) for t in (res.token_entropy, res.token_argmax, res.token_loss)]
    return (*per_token, res.loss)


def _make_forward(stock_forward):
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils.generic import can_return_tuple

    from solution.kernels.lm_head_loss import fused_lm_head_loss, shift_labels_like_stock
    from solution.step.decoder import capture_packed_hidden

    output_class = _output_class()

    cache_kw = cache_kwarg(stock_forward)  # "past_key_values" (transformers <= 5.23) or "cache" (5.24)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        # The KV cache argument stays in kwargs under the caller's name; the fused path runs only without one.
        if not _head_ok(self, labels, logits_to_keep, kwargs) or cache_given(kwargs):
            return stock_forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels,
                                 use_cache=use_cache, logits_to_keep=logits_to_keep, return_dict=True, **kwargs)
        drop_cache_args(kwargs)
        # The labelled tokens' count, read before the decoder is queued (one sync): the LM head's gradient
        # GEMM runs on those rows only (~36% of the shipped tokens have no label).
        labelled = int((labels[..., 1:] != -100).sum()) if torch.is_grad_enabled() else None
        # From here on: the stock forward's body, with the LM head + loss fused.
        with capture_packed_hidden() as packed:  # filled when the decoder ran on real tokens only
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache, **{cache_kw: None}, **kwargs)
        hidden_states = outputs.last_hidden_state
        weight = self.lm_head.weight
        dtype = _compute_dtype(hidden_states, weight)
        if (dtype is None or not runs_here(hidden_states.device) or weight.device != hidden_states.device
                or hidden_states.shape[-1] != weight.shape[1] or labels.shape != hidden_states.shape[:-1]):
            # Stock tail (logits_to_keep == 0 here, so the slice is the whole sequence).
            logits = self.lm_head(hidden_states)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                          attentions=outputs.attentions, **{cache_kw: getattr(outputs, cache_kw)})
        shift_labels = shift_labels_like_stock(labels.to(hidden_states.device))
        if packed:
            # only the real tokens' rows (pads: label -100, entropy weighed by attention_mask 0)
            token_entropy, token_argmax, token_loss, loss = _packed_lm_head(
                packed[0], weight, shift_labels, dtype, kwargs.get("num_items_in_batch"), labelled)
        else:
            res = fused_lm_head_loss(hidden_states, weight, shift_labels, compute_dtype=dtype,
                                     num_items_in_batch=kwargs.get("num_items_in_batch"),
                                     cache_weight=True, labelled_rows=labelled)
            token_entropy, token_argmax, token_loss, loss = res.token_entropy, res.token_argmax, res.token_loss, res.loss
        return output_class(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                            attentions=outputs.attentions, token_entropy=token_entropy, token_argmax=token_argmax,
                            token_loss=token_loss, **{cache_kw: getattr(outputs, cache_kw)})

    # stock's name, docstring and signature (__wrapped__): the Trainer inspects it (label names, **kwargs)
    functools.update_wrapper(forward, stock_forward)
    return forward


def _trainer_can_fuse(trainer, inputs) -> bool:
    """Settings in which trl 0.29.1's compute_loss does exactly what the mirror below does."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return (trainer.model.training and not trainer.args.use_liger_kernel
            and "labels" in inputs and "shift_labels" not in inputs
            and getattr(trainer, "num_virtual_tokens", 0) == 0 and not getattr(trainer, "aux_loss_enabled", False)
            and trainer.compute_loss_func is None and trainer.label_smoother is None
            and not (pc is not None and getattr(pc, "sp_enabled", False)))


def _make_compute_loss(sft_trainer_cls, stock_compute_loss):
    import trl.trainer.sft_trainer as sft_module

    step_attr = soup_step_attr()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # cleared on every call: Soup's rewind recorder never reads a previous step's per-token losses
        setattr(self, step_attr, None)
        if not _trainer_can_fuse(self, inputs):
            return stock_compute_loss(self, model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        # Below: trl 0.29.1 SFTTrainer.compute_loss (training cases), metrics from the fused outputs when present.
        mode = "train"
        inputs.pop("_prediction_loss_only", None)
        labels = inputs["labels"]
        inputs["use_cache"] = False
        with fused_lm_head_requested():
            (loss, outputs) = super(sft_trainer_cls, self).compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        token_entropy = getattr(outputs, "token_entropy", None)
        token_argmax = getattr(outputs, "token_argmax", None)
        token_loss = getattr(outputs, "token_loss", None)
        if token_entropy is None:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            say_once(f"fused LM-head loss not used for {type(base).__name__} (another architecture or "
                      "unsupported inputs): stock loss and metrics from the logits")

        # Compute entropy
        with torch.no_grad():
            if token_entropy is not None:
                per_token_entropy = token_entropy
            else:  # the forward declined the fused path: stock computation from the logits
                per_token_entropy = sft_module.entropy_from_logits(outputs.logits)
            if "attention_mask" in inputs:
                attention_mask = inputs["attention_mask"]
                entropy = torch.sum(per_token_entropy * attention_mask) / attention_mask.sum()
            elif "position_ids" in inputs:
                entropy = torch.mean(per_token_entropy)
            else:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
            entropy = self.accelerator.gather_for_metrics(entropy).mean().item()
        self._metrics[mode]["entropy"].append(entropy)

        if "attention_mask" in inputs:
            num_tokens_in_batch = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        elif "position_ids" in inputs:
            local_num_tokens = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
            num_tokens_in_batch = self.accelerator.gather_for_metrics(local_num_tokens).sum().item()
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        self._total_train_tokens += num_tokens_in_batch
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

        # Compute accuracy (argmax at position i vs label i + 1, on non -100 labels), as trl does
        with torch.no_grad():
            shift_labels = labels[..., 1:].contiguous()
            if token_argmax is not None:
                predictions = token_argmax[..., :-1]
            else:
                shift_logits = outputs.logits[..., :-1, :].contiguous()
                predictions = shift_logits.argmax(dim=-1)
            mask = shift_labels != -100
            correct_predictions = (predictions == shift_labels) & mask
            total_tokens = mask.sum()
            correct_tokens = correct_predictions.sum()
            step = None if token_loss is None else FusedLMHeadStep(
                token_entropy=per_token_entropy, token_loss=token_loss, correct=correct_tokens, labelled=total_tokens)
            correct_tokens = self.accelerator.gather_for_metrics(correct_tokens)
            total_tokens = self.accelerator.gather_for_metrics(total_tokens)
            total_sum = total_tokens.sum()
            accuracy = (correct_tokens.sum() / total_sum).item() if total_sum > 0 else 0.0
            self._metrics[mode]["mean_token_accuracy"].append(accuracy)

        setattr(self, step_attr, step)  # for Soup's rewind recorder, which reads it right after we return
        return (loss, outputs) if return_outputs else loss

    functools.update_wrapper(compute_loss, stock_compute_loss)
    return compute_loss


def check() -> str | None:
    try:
        from transformers.models.qwen2 import modeling_qwen2
        from trl.trainer.sft_trainer import SFTTrainer
    except Exception as exc:  # noqa: BLE001 - any import problem means: keep stock
        return f"transformers Qwen2 / trl SFTTrainer not importable ({type(exc).__name__}: {exc})"
    import trl.trainer.sft_trainer as sft_module
    from transformers.loss import loss_utils

    from solution.patches._sources import first_unexpected

    # private tensor attribute: the cached fp16 LM-head weight is keyed by the weight's version counter
    if not isinstance(getattr(torch.empty(0), "_version", None), int):
        return "this torch's tensors have no _version counter (the LM head's weight cache is keyed by it)"
    # the two methods mirrored, and the loss / entropy the fused kernel computes in their place
    return first_unexpected(
        ("transformers.Qwen2ForCausalLM.forward", modeling_qwen2.Qwen2ForCausalLM.forward),
        ("trl.SFTTrainer.compute_loss", SFTTrainer.compute_loss),
        ("transformers.ForCausalLMLoss", getattr(loss_utils, "ForCausalLMLoss", None)),
        ("transformers.fixed_cross_entropy", getattr(loss_utils, "fixed_cross_entropy", None)),
        ("trl.entropy_from_logits", getattr(sft_module, "entropy_from_logits", None)))


def install(swaps) -> str:
    from transformers.models.qwen2 import modeling_qwen2
    from trl.trainer.sft_trainer import SFTTrainer

    stock_forward = modeling_qwen2.Qwen2ForCausalLM.forward
    stock_compute_loss = SFTTrainer.compute_loss
    swaps.set(modeling_qwen2.Qwen2ForCausalLM, "forward", _make_forward(stock_forward))
    swaps.set(SFTTrainer, "compute_loss", _make_compute_loss(SFTTrainer, stock_compute_loss))
    return ("Qwen2ForCausalLM.forward + SFTTrainer.compute_loss: LM head, loss, entropy and token "
            "accuracy fused chunk by chunk (no [tokens, vocab] logits kept)")
