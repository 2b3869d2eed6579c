"""The packed training step, in layers (each imports only the ones above it):

1. ``packing``     the batch's real tokens as packed rows (``Unpadded``), pad/unpad, the mask source
2. ``attention``   whether variable-length attention runs on this machine (``varlen_works``)
3. ``layer``       each decoder layer as one autograd node (planner: patches/qwen2_layer_node.py)
4. ``cuda_graphs`` CUDA graphs over the decoder layers (with graph_buffers, graph_decision, lengths)
5. ``decoder``     which forwards run packed (``plan``) and the packed Qwen2Model body

patches/qwen2_unpad.py wires layer 5 into transformers, qwen2_layer_node.py installs layer 3's planner; nothing
here imports solution.patches but ``_sources``. This file imports nothing (a kernel may import ``packing`` alone).
"""
