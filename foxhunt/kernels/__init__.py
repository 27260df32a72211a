"""foxhunt's hand-written kernels, apart from the networks that use them, each beside the plain reference it must equal.

- ``mamba2_block.c`` / :mod:`foxhunt.kernels.mamba2_block`: the Mamba-2 block's CPU loops (causal convolution with
  SiLU, the SSD step by step with its adjoint, the norms), built for the block's shape on first use and checked
  against :mod:`foxhunt.kernels.ssd_recurrence` (the SSD step by step in float64 PyTorch) when loaded;
- :mod:`foxhunt.kernels.build`: the one loader: compile with the system's C compiler into the user's cache, verify by
  SHA-256, self-check, or give None (and the caller runs its PyTorch path) where there is no compiler or
  ``FOXHUNT_NATIVE=0``.

The C sources are package data (``pyproject.toml``), read from beside their loader; none lives in a Python string.
"""
