"""Per-tensor statistics, checksums and the divergence metrics (numpy/numba kernels)."""
