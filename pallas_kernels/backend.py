"""The `pallas_sm90` registry entry: everything the op core needs from this package."""

from __future__ import annotations

import jax.numpy as jnp

from detlogp_jax.backends import Backend, DzKernel, InPlaceWalk

# Whether the registry entry declares the entropy statistic (`linear-logp-entropy-v1`,
# `Backend.entropy`; the kernels compute it: `partials(..., return_entropy=True)`,
# `fold(..., a=A)`). False would make `linear_logp(return_entropy=True,
# backend="pallas_sm90")` refuse (and `auto` fall back to `reference`). True since the
# H200 confirmed its bits (2026-12-01, benchmarks/results/h200_2026-12-01b/: ladder F1
# and F2 PASS, 0 rows differing over M = 1..16384, every bucket; the GPU golden entropy
# records recorded, replayed in a fresh process and merged into the packaged file).
# A kernel change that touches the statistic sets it False again until
# tests/gpu/h200_entropy.sh passes. (Not an environment variable: the op refuses unknown
# DETLOGP_* variables. tests/gpu/with_entropy.py sets it in one process for validation.)
ENTROPY_VALIDATED = True


def backend_entry() -> Backend:
    """The contract-bearing Hopper backend (registered by `detlogp_jax.backends` through its plugin spec)."""
    import pallas_kernels as pk
    from pallas_kernels import sm90_dz, sm90_grad_gemm, wrapper

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
        # deterministic, not frozen), so it does not wait for ENTROPY_VALIDATED; the GPU
        # gradient tests (tests/gpu/test_grad_gpu.py) check it against float64 and the
        # XLA-formed dz in both layouts, with and without the entropy term.
        dz=DzKernel(
            fn=sm90_dz.dz_chunk,
            supports=lambda h, w, chunk, weight_layout: (
                h.dtype == jnp.bfloat16
                and wrapper.unsupported(h, w, weight_layout) is None
                and sm90_dz.chunk_supported(chunk)
            ),
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
                supports=lambda n_pad, d, v_rows, chunk, weight_layout: (
                    v_rows % sm90_grad_gemm.START_MULTIPLE == 0 and sm90_grad_gemm.supported(n_pad, d, chunk)
                ),
                dw_cols_supported=sm90_grad_gemm.cols_supported,
            ),
        ),
        description="Pallas Mosaic GPU kernel for Hopper (sm_90): wgmma + TMA, fused streaming LSE",
        knobs=frozenset({"bucket", "num_ctas"}),
        unavailable_reason=pk.unavailable_reason,
        entropy=ENTROPY_VALIDATED,
    )
