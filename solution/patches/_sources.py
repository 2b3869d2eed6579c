"""The stock sources our patches mirror, by sha256, and the library versions they were read in.

A patch that re-implements a stock function's body (to fuse part of it) must only run where that
body is the one it mirrors. Each function below is accepted when the sha256 of its installed
source (``inspect.getsource`` of the undecorated function) is one of the listed ones; each listed
hash was checked by reading the diff against the version the patch was written for
(transformers 5.17.0, trl 0.29.1) and finding nothing that changes what the mirror computes.
Any other source (a newer release, a local edit) makes the patch refuse to install, and that part
of training runs the stock code.

Reviewed (2026-11-30), transformers 5.16.1 ... 5.24.0, trl 0.29.0 / 0.29.1 (Soup 0.77.0 allows
transformers >= 5.16.1, < 6 and trl >= 0.29, < 1):
- 5.19.0: sdpa_attention_forward gains a paged-attention cache branch (only with a
  PagedAttentionCache, never in training) - accepted.
- 5.21.0: Qwen2ForCausalLM.forward slices hidden states through ``slice_logits_to_keep`` (same
  result for logits_to_keep == 0, the only case the fused path takes); sdpa raises on ``softcap``
  (Qwen2 has none) - accepted.
- 5.23.0: type hints (``inputs_embeds: torch.Tensor``); sdpa packs GQA heads for one-token
  queries (decoding only) - accepted.
- 5.24.0: ``past_key_values`` renamed ``cache`` (arguments of the CausalLM, the model and the
  decoder layer, fields of the outputs; the old name kept as a deprecated alias); sdpa's paged
  cache branch moved out - accepted: the mirrors take the cache argument's name from the installed
  signature (``cache_kwarg``) and the decoder layer passes it through untouched.
- Qwen2Attention.forward (mirrored by the decoder-layer node, solution/step/layer.py): one source
  from 5.16.1 to 5.23.0; 5.24.0 renames ``past_key_values`` to ``cache`` (with ``deprecate_kwarg``)
  and passes ``kwargs`` to ``cache.update`` - accepted: the node runs only without a cache.
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
    "transformers.sdpa_attention_forward": {
        "2519bd4da7bc7181c84f14ed764249b88bef262fd75f2b441d3e5b23a88c4a96": "5.16.1-5.18.0",
        "6a965ca3df2d5f0856625f6259718f9645cfc4ab54e2bd56173af4faa3f056e4": "5.19.0-5.20.2",
        "b3604d235f012925ac45eed5d02cd54df1fec4aff6ca549181241ff69cf71a44": "5.21.0-5.22.2",
        "e3d016070b6ac957cd7b419a9f3572c8caafa0c0e1d135e70afb80e9c495eb8d": "5.23.0",
        "9be3d6b1f79abc00ee3a03325c51d1d09127d3155af6cb7bbdf59a49a8aaa412": "5.24.0",
    },
    # peft_model_walks: with the mode unchanged it is Module.train (read in 5.16.1, 5.17.0, 5.20.2, 5.24.0)
    "transformers.PreTrainedModel.train": {
        "9b2adf55d0b3d6b87a64e46cb18330839ba51c45b7ae06dec3ff9cbd60765c5b": "5.16.1-5.24.0",
    },
    # trainer_clip: the clip's uses of the parameter list (read in transformers 5.17.0, accelerate 1.15.0,
    # the workload's pins)
    "transformers.Trainer._clip_grad_norm": {
        "ebfa9dc91d3088aba72171b63dad101b1d91d8470b871394b027302e472487a4": "5.17.0",
    },
    "accelerate.Accelerator.clip_grad_norm_": {
        "07bab36d3993512552617e6f9f1c620137c656fd7de5fe96da56d81d88e59894": "1.15.0",
    },
    "accelerate.Accelerator._clip_grad_norm_dtensor_aware": {
        "3db384a087407c3cd859b5e8fa4d4dfbfe270929721b828d07a5e4ff202189d6": "1.15.0",
    },
    "trl.SFTTrainer.compute_loss": {
        "949aa5ebf4ec1e6a69c59a958effc389963427174d4fdb5bac6fc02606dc4fb0": "0.29.0-0.29.1",
    },
}


def checkpointing_body(forward):
    """The plain body under transformers' ``forward_with_checkpointing`` (from 5.23 each
    GradientCheckpointingLayer subclass's forward is wrapped in it when the class is created;
    recognised by its code's name, since ``functools.wraps`` copies the function's name), or None
    when ``forward`` is not that wrapper (up to 5.22 ``__call__`` checkpoints and ``forward`` is the
    plain body)."""
    if getattr(getattr(forward, "__code__", None), "co_name", "") == "forward_with_checkpointing":
        return forward.__wrapped__
    return None


def source_sha256(fn) -> str:
    """sha256 of the source text of ``fn`` (decorators unwrapped), as the hashes above were taken."""
    return hashlib.sha256(inspect.getsource(inspect.unwrap(fn)).encode()).hexdigest()


def unexpected_source(name: str, fn) -> str | None:
    """None when the installed ``fn`` is one of the reviewed sources of ``name``, else the reason."""
    try:
        digest = source_sha256(fn)
    except (OSError, TypeError) as exc:
        return f"cannot read the source of {name} ({exc})"
    if digest in ACCEPTED[name]:
        return None
    versions = ", ".join(sorted(set(ACCEPTED[name].values())))
    return f"{name} is not one of the reviewed sources (versions {versions})"


def cache_kwarg(fn) -> str:
    """The name of the KV-cache argument of an installed transformers forward: ``cache`` (5.24 on)
    or ``past_key_values`` (before); outputs name their field the same way."""
    return "cache" if "cache" in inspect.signature(inspect.unwrap(fn)).parameters else "past_key_values"


CACHE_ARGS = ("past_key_values", "cache")  # the KV-cache argument's names, before and from 5.24


def cache_given(kwargs: dict) -> bool:
    """Does a call's kwargs carry a KV cache (under either name)?"""
    return any(kwargs.get(name) is not None for name in CACHE_ARGS)


def drop_cache_args(kwargs: dict) -> None:
    """Remove the (None) KV-cache arguments from kwargs, under either name."""
    for name in CACHE_ARGS:
        kwargs.pop(name, None)

