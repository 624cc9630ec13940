"""pallas_sm90 for the batch-invariant body: the Hopper kernels behind `detlogp_jax.body`.

`body_entry()` returns the `BodyBackend` that `detlogp_jax.body.backends` registers by its
plugin spec "pallas_kernels.body:body_entry". Available on a CUDA GPU of compute capability
9.x (`pallas_kernels.is_available`).

Modules: `matmul` (host side of the GEMM: `matmul`, `supports`), `matmul_kernel` (the
kernel), `matmul_config` (its frozen launch configs per M bucket and the instruction N);
`attention` (host side of the KV-cache attention: `attention`, `supports`),
`attention_kernel` (the kernel), `attention_config` (its frozen, bit-neutral launch configs).
"""

from __future__ import annotations

from detlogp_jax.body.backends import BodyBackend

BACKEND_NAME = "pallas_sm90"


def body_entry() -> BodyBackend:
    """The invariant Hopper body backend (its ops: see the module docstring)."""
    import pallas_kernels as pk
    from pallas_kernels.body import attention, matmul

    return BodyBackend(
        name=BACKEND_NAME,
        invariant=True,
        available=pk.is_available,
        unavailable_reason=pk.unavailable_reason,
        matmul=matmul.matmul,
        supports_matmul=matmul.supports,
        attention=attention.attention,
        supports_attention=attention.supports,
        description="Pallas Mosaic GPU kernels for Hopper (sm_90): TMA + wgmma, one f32 accumulator, K ascending",
    )


__all__ = ["BACKEND_NAME", "body_entry"]
