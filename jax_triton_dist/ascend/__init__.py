"""The Ascend lane: every kernel of ``kernels/`` compiled with triton-ascend down to HIVM IR
(``python -m jax_triton_dist.ascend lower``), with the ``dl`` primitives mapped either to
trailing kernel arguments (``args``) or to ACLSHMEM calls (``aclshmem``), and a check that
the distributed semantics survive the compiler.

Modules: ``catalog`` (the kernels as the ops launch them), ``lowering`` (the stages, in the
triton-ascend environment), ``aclshmem_calls`` (placeholders to ``dist.aclshmem_*`` calls),
``checks`` (counts of flag writes, waits and barriers), ``report`` (records and tables),
``worker`` (the entry point there), ``__main__`` (the command). This package's ``__init__``
imports nothing: the worker loads it where JAX is not installed.
"""
