"""Distributed Triton kernels (pure Triton + ``jax_triton_dist.language``), one op family per
module. Installed as ``jax_triton_dist.kernels``."""
