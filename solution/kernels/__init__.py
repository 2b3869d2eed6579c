"""Our Triton kernels, one op per file. Each file holds the @triton.jit kernels, the launcher,
the torch.autograd.Function, and ``sm75_specs()`` (every launch configuration it uses, so that a
test can compile all of them for the T4 without a T4)."""
