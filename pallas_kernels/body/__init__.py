"""pallas_sm90 for the batch-invariant body: the Hopper kernels behind `detlogp_jax.body`.

`body_entry()` returns the `BodyBackend` that `detlogp_jax.body.backends` registers by its
plugin spec "pallas_kernels.body:body_entry". Available on a CUDA GPU of compute capability
9.x (`pallas_kernels.is_available`).
"""

from __future__ import annotations

from detlogp_jax.body.backends import BodyBackend

BACKEND_NAME = "pallas_sm90"


def body_entry() -> BodyBackend:
    """The invariant Hopper body backend (its ops: see the module docstring)."""
    import pallas_kernels as pk

    return BodyBackend(
        name=BACKEND_NAME,
        invariant=True,
        available=pk.is_available,
        unavailable_reason=pk.unavailable_reason,
        description="Pallas Mosaic GPU kernels for Hopper (sm_90): TMA + wgmma, one f32 accumulator, K ascending",
    )


__all__ = ["BACKEND_NAME", "body_entry"]
