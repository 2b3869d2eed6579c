"""Our Triton kernels, one op per file. Each file holds the @triton.jit kernels, their launchers and
``sm75_specs()`` (every launch configuration it uses, so that a test can compile all of them for the
T4 without a T4). The decoder-layer node's autograd node (solution/step/layer.py) calls the launchers;
lm_head_loss.py has a torch.autograd.Function of its own."""
