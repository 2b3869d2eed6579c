"""Wiring of our kernels into transformers / peft / bitsandbytes / trl: one file per thing patched.

PATCHES lists them in install order; solution._apply walks it.
"""
PATCHES = [
    "solution.patches.qwen2_layer_node",
    "solution.patches.qwen2_lm_head_loss",
    "solution.patches.qwen2_unpad",
    "solution.patches.trainer_lengths",
    "solution.patches.trainer_flops",
    "solution.patches.trainer_clip",
    "solution.patches.peft_model_walks",
]
