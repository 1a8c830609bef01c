"""Ragged paged attention and the dequantizing matmul: each a Pallas kernel, a pure-jnp reference in the same file,
an XLA path and (on the CPU) a native kernel, chosen by an `impl` switch through the kernel registries
(`pallas_kernels.registry`). Importing the package loads both kernel modules, which register their families'
contracts and built-in implementations."""

from pallas_kernels import dequant_matmul, paged_attention  # noqa: F401 (registers the built-ins)
