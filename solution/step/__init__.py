"""The packed training step, in layers (each imports only the ones above it):

1. ``packing``     the batch's real tokens as packed rows (``Unpadded``), pad/unpad, the LoRA
                   dropout draw shape and mask source (torch only)
2. ``attention``   attention over packed rows (``sdpa_unpadded``) and its kernel switches
3. ``cuda_graphs`` CUDA graphs over the decoder layers: the measured decision, capture, replay
4. ``decoder``     which forwards run packed (``plan``) and the packed Qwen2Model body

solution/patches/qwen2_unpad.py wires layers 4 and 2 into transformers; nothing here imports
solution.patches except the source-version helpers (``_sources``). This file imports nothing,
so a kernel may import ``solution.step.packing`` without pulling in the other layers.
"""
