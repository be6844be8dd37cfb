"""Pure-torch reference kernels: the oracle every faster backend is compared against."""
