"""The `pallas_sm90` registry entry: everything the op core needs from this package.

The entry declares the entropy statistic (`linear-logp-entropy-v1`, `Backend.entropy`; the
kernels compute it: `partials(..., return_entropy=True)`, `fold(..., a=A)`): its bytes were
validated on the H200 (tests/gpu/h200_entropy.sh: the ladder's F stages, the GPU golden
entropy records). A kernel change that touches the statistic must pass that validation again
before it ships. Every `weight_layout` the entry's functions take is "vd" / "dv" or a
`detlogp_jax.layout.WeightLayout` (converted once, where each function starts).
"""

from __future__ import annotations

import jax.numpy as jnp

from detlogp_jax.backends import Backend, DzKernel, InPlaceWalk
from detlogp_jax.layout import as_layout


def backend_entry() -> Backend:
    """The contract-bearing Hopper backend (registered by `detlogp_jax.backends` through its plugin spec)."""
    import pallas_kernels as pk
    from pallas_kernels import sm90_dz, sm90_grad_gemm, wrapper

    def dz_supports(h, w, chunk, weight_layout):
        return (
            h.dtype == jnp.bfloat16
            and wrapper.unsupported(h, w, as_layout(weight_layout)) is None
            and sm90_dz.chunk_supported(chunk)
        )

    def in_place_supports(n_pad, d, v_rows, chunk, weight_layout):
        as_layout(weight_layout)  # (either layout: refuses anything else)
        return v_rows % sm90_grad_gemm.START_MULTIPLE == 0 and sm90_grad_gemm.supported(n_pad, d, chunk)

    return Backend(
        name="pallas_sm90",
        contract_bearing=True,
        available=pk.is_available,
        supports=pk.supports,
        partials=pk.partials,
        fold=pk.fold,
        fused_forward=pk.forward,
        # The forward kernels read [V, D] and [D, V] weights in place (same bytes: the
        # K walk, instruction shapes and trees do not depend on where wgmma's B comes from).
        layouts=frozenset({"vd", "dv"}),
        # The dz kernel reads [chunk, D] ("vd") and [D, chunk] ("dv") weight chunks and takes
        # the entropy term (c3, h). It is not part of the contract (the backward is
        # deterministic, not frozen); the GPU gradient tests (tests/gpu/test_grad_gpu.py) check
        # it against float64 and the XLA-formed dz in both layouts, with and without the
        # entropy term.
        dz=DzKernel(
            fn=sm90_dz.dz_chunk,
            supports=dz_supports,
            row_multiple=sm90_dz.ROWS_PER_CTA,
            layouts=frozenset({"vd", "dv"}),
            entropy=True,
            # The chunk walk without copies: the dz kernel and the dh GEMM read the weight at the
            # chunk's offset, the dW GEMM writes dW at it (sm90_grad_gemm); grad.backward keeps
            # XLA's GEMMs on slices where these kernels do not tile the operands.
            in_place=InPlaceWalk(
                dz=sm90_dz.dz_in_place,
                dh=sm90_grad_gemm.dh_accumulate,
                dw=sm90_grad_gemm.dw_write,
                supports=in_place_supports,
                dw_cols_supported=sm90_grad_gemm.cols_supported,
            ),
        ),
        description="Pallas Mosaic GPU kernel for Hopper (sm_90): wgmma + TMA, fused streaming LSE",
        knobs=frozenset({"bucket", "num_ctas"}),
        unavailable_reason=pk.unavailable_reason,
        entropy=True,
    )
