"""The packed training step, in layers (each imports only the ones above it):

1. ``packing``     the batch's real tokens as packed rows (``Unpadded``), pad/unpad, the LoRA
                   dropout draw shape and mask source (torch only)
2. ``attention``   whether variable-length attention runs on this machine (``varlen_works``)
3. ``layer``       each decoder layer as one autograd node (its plan made by the planner that
                   solution/patches/qwen2_layer_node.py installs)
4. ``cuda_graphs`` CUDA graphs over the decoder layers: the measured decision, capture, replay
5. ``decoder``     which forwards run packed (``plan``) and the packed Qwen2Model body

solution/patches/qwen2_unpad.py wires layer 5 into transformers, qwen2_layer_node.py
installs layer 3's planner; nothing here imports solution.patches except the source-version
helpers (``_sources``). This file imports nothing,
so a kernel may import ``solution.step.packing`` without pulling in the other layers.
"""
