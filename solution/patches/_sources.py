"""The stock sources our patches mirror, by sha256 (docs/GATES.md: every gate, the ranges, what each review found).

A patch that re-implements a stock function's body, or relies on what it does beyond its documented contract,
runs only where that body is the one it mirrors: where the sha256 of the installed source (``inspect.getsource``
of the undecorated function) is listed below, each hash taken from the wheels of every release in its range and
its diff reviewed. Any other source: the patch's ``check()`` gives the reason, apply() prints it, and that part
of training runs the stock code (tests/test_gates.py).
"""
from __future__ import annotations

import hashlib
import inspect

ACCEPTED: dict[str, dict[str, str]] = {
    "transformers.Qwen2ForCausalLM.forward": {
        "e7cc0724264fb97ab48ea8e9beeee6edadc87d486085501b2703576b2b2bc183": "5.16.1-5.20.2",
        "2e49fae88f3208b4d9dd0e83d9f9ad083aaeffcf977b24e132bd605ef9016a18": "5.21.0-5.22.2",
        "eb9111d837a8aacb4182220b93d7d6c991b076bc8f613b54eb1c7e8250c07505": "5.23.0",
        "fa830c43105026921f5565f25ed02ccb465cc628e81eafd9542137fad89edacf": "5.24.0",
    },
    "transformers.Qwen2Model.forward": {
        "523115d50c78f82f5256cc0aa9cba43732f8f6b92bef4831382a07c570c2b076": "5.16.1-5.22.2",
        "7fb64c79b3ddce2fcf8f4556616579364caf4d15136062cb4d380a803f70ccc5": "5.23.0",
        "c202eeb4c426724157bfa5c3711e916dbab001331e5a2355bf49fa385a7163f6": "5.24.0",
    },
    "transformers.Qwen2DecoderLayer.forward": {
        "75d1d62e173e8c574b8a61338d1fa5052774d13b848eecd282cde88cd6690b8e": "5.16.1-5.23.0",
        "2b52523b7afe2a371de1384a5c81b6f64e9a32b7490388160afea6edb28ff5c2": "5.24.0",
    },
    "transformers.Qwen2Attention.forward": {
        "3d7ae1485294d0c8d57827617a3abed805bcf0c4107ead3d1a47f67eee7dcb1b": "5.16.1-5.23.0",
        "958fda1e108c1fe850f10c41d41d1a3b9281261cf76cb71835433fdf87fddb17": "5.24.0",
    },
    # peft_model_walks: with the mode unchanged it is Module.train (read in 5.16.1, 5.17.0, 5.20.2, 5.24.0)
    "transformers.PreTrainedModel.train": {
        "9b2adf55d0b3d6b87a64e46cb18330839ba51c45b7ae06dec3ff9cbd60765c5b": "5.16.1-5.24.0",
    },
    # trainer_clip: the clip's uses of the parameter list (transformers, accelerate, torch)
    "transformers.Trainer._clip_grad_norm": {
        "ebfa9dc91d3088aba72171b63dad101b1d91d8470b871394b027302e472487a4": "5.17.0-5.24.0",
    },
    "accelerate.Accelerator.clip_grad_norm_": {
        "07bab36d3993512552617e6f9f1c620137c656fd7de5fe96da56d81d88e59894": "1.15.0-1.16.0",
    },
    "accelerate.Accelerator._clip_grad_norm_dtensor_aware": {
        "3db384a087407c3cd859b5e8fa4d4dfbfe270929721b828d07a5e4ff202189d6": "1.15.0",
        "52e8e5fb0500a84472684fcd0b2ea5267be2acaec023b982adf9ec601819558c": "1.16.0",
    },
    "torch.nn.utils.clip_grad_norm_": {
        "ec7e5ef692a2f1679f547a8899fd9d29e934b1f8791d78546821927483d379ca": "2.10.0-2.13.0",
    },
    "torch.nn.utils.clip_grad._get_total_norm": {
        "aa9db112a11db218985a61b103e530cac0cbc73055d78a1940717fd8ba7aa504": "2.10.0",
        "36543c2a7c6150b05b9bc2b334310643c678baa22c79e52059baf32b289c9901": "2.11.0-2.13.0",
    },
    "torch.nn.utils.clip_grad._clip_grads_with_norm_": {
        "c630d283fe216a3c5fd484b9dafd25adbd2d9f76214806affe5e3b5da1eeaa64": "2.10.0-2.13.0",
    },
    "trl.SFTTrainer.compute_loss": {
        "949aa5ebf4ec1e6a69c59a958effc389963427174d4fdb5bac6fc02606dc4fb0": "0.29.0-0.29.1",
    },
    # qwen2_lm_head_loss: the fused kernel computes stock's loss and trl's entropy
    "transformers.ForCausalLMLoss": {
        "c7f950f4eb7eba01f9339bc4937c9e1cc2885cf1c1bc116d764990c694a90ff9": "5.16.1-5.24.0",
    },
    "transformers.fixed_cross_entropy": {
        "a7d1a68de5ca0ce6fad1f39ac53e33d96d67077ee18597d85ccacc63540ac9eb": "5.16.1-5.24.0",
    },
    "trl.entropy_from_logits": {
        "cfeed25ed40872baac62ba7748bf4a43e994377da6236ac84b3b99252702fc93": "0.29.0-0.29.1",
    },
    # the decoder-layer node (qwen2_layer_node): the norm's formula, which kernels/rmsnorm.py reproduces
    "transformers.Qwen2RMSNorm.forward": {
        "790fa612e4fa57acfcbea31da45f92ba91f9016f7260ef539f61c5530ba06a5f": "5.16.1-5.24.0",
    },
    # the node: RoPE, x * cos + rotate_half(x) * sin
    "transformers.apply_rotary_pos_emb": {
        "ea234325c15de475147027ac7da4307167d082b13f4c62a7f2921fef4f9e5e87": "5.16.1-5.24.0",
    },
    "transformers.rotate_half": {
        "f714a4b1160c694e270d9191a9f133e53856e2a1c62f5cd2f85740f7c2692397": "5.16.1-5.24.0",
    },
    # the node: down_proj(act_fn(gate_proj(x)) * up_proj(x))
    "transformers.Qwen2MLP.forward": {
        "03df2d7685cf8446594448cbd33ef676a2b088779d99d9803abe3bed2ec7ad9b": "5.16.1-5.24.0",
    },
    # trainer_flops: the count floating_point_ops asks for, memoized per run
    "transformers.Trainer.floating_point_ops": {
        "ffd8b0eb8cf7c98b1e7f87e65584a17d87a4a61741743099e9fe3ded1216f4ee": "5.16.1-5.24.0",
    },
    "transformers.PreTrainedModel.num_parameters": {
        "2957f95a8c09005441aa8edfe9343c86edbaa689a9cc04712dec6979e566076b": "5.16.1-5.24.0",
    },
    # peft_model_walks: torch's walks, flags and gradient clearing
    "torch.nn.Module.named_modules": {
        "8e6a8186ac543749f16317ad00b514750fd1fb09b774ba82cbd8708ff128186f": "2.10.0-2.11.0, 2.13.0",
        "5f286a5849e9ed066cde65778735597f8f133cc773d7ad93d2aa3a2b09864d8f": "2.12.0-2.12.1",
    },
    "torch.nn.Module.named_parameters": {
        "a5cf801eda9c82c1e6e7eb2ac634f295a35e9524d348f5424bc5fa3f67b9eb1a": "2.10.0-2.13.0",
    },
    "torch.nn.Module._named_members": {
        "eb15b8046105757d20d76a4735a8b6326ba7e834d1d2c4366f5749b9ac93919e": "2.10.0-2.13.0",
    },
    "torch.nn.Module.parameters": {
        "be760a33b3944208c64d632ae8bbe85f71e6afc62a7931e8532bc3a8c105ba06": "2.10.0-2.13.0",
    },
    "torch.nn.Module.train": {
        "9e2ebb28709740467a7bd7c5898d3f2437b99f2c17079e249605adf3a77acb20": "2.10.0-2.13.0",
    },
    "torch.nn.Module.zero_grad": {
        "e2acaefe95021c77747b2c285044f4ef353be47fe223ea47d20ab10322d70f3a": "2.10.0-2.13.0",
    },
    # qwen2_layer_node: the node's own checkpointing stands in for it (``step.layer.own_checkpoint``'s options)
    "torch.utils.checkpoint.checkpoint": {
        "13cd61e07e801e1f6c2c85a1207b5f13626571b3fc3b4caab3d9a6a4a147d241": "2.10.0-2.11.0",
        "3d03debbb03f48589d88274250600ea00768dc0f07c50c020a9eb3fe755c83f1": "2.12.0-2.12.1",
        "de8fda2b752d7303296bc7c2ece331fa505a995a846f2858058932b5b0c9012d": "2.13.0",
    },
    # the node's LoRA: peft's forward (dropout, then lora_A, lora_B, scaling; the base layer first)
    "peft.tuners.lora.bnb.Linear4bit.forward": {
        "ba53967c7f8574384a160a6a897e8ec6205718e9bfef9d6998cb40cb8bcf6eb8": "0.20.0-0.21.2",
    },
    # the node's NF4 linears (patches/_bnb.py): bitsandbytes' forward (quant-state repair, bias cast) and matmul
    "bitsandbytes.nn.Linear4bit.forward": {
        "d52cf63457717cc718ca0a449dad0967171e679be90d5d2adcafe2e8a141093d": "0.50.0-0.50.2",
    },
    "bitsandbytes.matmul_4bit": {
        "a219d40d62264de60a424e8f9f1bab7656136eb7264a575d39d57a7e2f25ed4a": "0.50.0-0.50.2",
    },
}


def source_sha256(fn) -> str:
    """sha256 of the source text of ``fn`` (decorators unwrapped), as the hashes above were taken."""
    return hashlib.sha256(inspect.getsource(inspect.unwrap(fn)).encode()).hexdigest()


def _reason(name: str, digest) -> str | None:
    """None when ``digest()`` is one of the reviewed hashes of ``name``, else the reason."""
    try:
        value = digest()
    except (OSError, TypeError, SyntaxError, ImportError, ValueError) as exc:
        return f"cannot read the source of {name} ({exc})"
    if value in ACCEPTED[name]:
        return None
    versions = ", ".join(sorted(set(ACCEPTED[name].values())))
    return f"{name} is not one of the reviewed sources (versions {versions})"


def unexpected_source(name: str, fn) -> str | None:
    """None when the installed ``fn`` is a reviewed source of ``name``, else the reason (also for ``fn`` None)."""
    if fn is None:
        return f"{name} does not exist"
    return _reason(name, lambda: source_sha256(fn))


def first_unexpected(*pairs) -> str | None:
    """The first reason ``unexpected_source`` gives over ``(name, fn)`` pairs, or None."""
    for name, fn in pairs:
        reason = unexpected_source(name, fn)
        if reason is not None:
            return reason
    return None


def cache_kwarg(fn) -> str:
    """The KV-cache argument's (and output field's) name in an installed forward: ``cache`` or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(inspect.unwrap(fn)).parameters else "past_key_values"


CACHE_ARGS = ("past_key_values", "cache")  # the KV-cache argument's names, before and from 5.24


def cache_given(kwargs: dict) -> bool:
    """Does a call's kwargs carry a KV cache (under either name)?"""
    return any(kwargs.get(name) is not None for name in CACHE_ARGS)


def drop_cache_args(kwargs: dict) -> None:
    """Remove the (None) KV-cache arguments from kwargs, under either name."""
    for name in CACHE_ARGS:
        kwargs.pop(name, None)

