"""pallas_sm90: the contract-bearing Pallas Mosaic GPU backend for Hopper (sm90).

Interface (mirrors `detlogp_jax.reference`):
  partials(hidden, weight, bias, targets, inv_t, *, vocab_size, padded_vocab_size,
           col_offset=0, shard_cols=None, return_logits=False, weight_layout="vd",
           return_entropy=False)
      -> (m [N, n_local], s [N, n_local], z_t [N], owned [N], logits [N, Vl] | None)
         (+ A [N, n_local], the entropy statistic, with return_entropy=True)
  fold(m, s, z_t, targets, inv_t, vocab_size, a=None) -> (logp [N], lse [N])
         (+ entropy [N] with a=A: `linear-logp-entropy-v1`, docs/CONTRACT.md section 9)
  forward(hidden, weight, bias, targets, inv_t, *, vocab_size, padded_vocab_size, ...)
      -> (logp, lse, logits | None, entropy | None): fold(partials(...)) of an unsharded
         head in one call, the same bytes, no re-layout of the partials between the kernels
plus `is_available()`, `unavailable_reason()`, `supports(hidden, weight)`,
`shard_geometry`, the launch table `BUCKETS` / `select_bucket`, the
bit-neutral launch knobs `bucket=` / `num_ctas=` and the CPU `interpret=` switch.
Every `weight_layout=` takes "vd" / "dv" or a `detlogp_jax.layout.WeightLayout`.

Supported: bf16 hidden and weight, D a positive multiple of 64, a CUDA GPU of
compute capability 9.x (or interpret mode on any host). The registry entry
(`backend.py`) declares the entropy statistic (validated on the H200:
tests/gpu/h200_entropy.sh). The weight is read in place in either layout: [V, D]
("vd", lm_head) or [D, V] ("dv", a Flax/Tunix kernel; V a multiple of 64), same
kernels, same bytes.

Modules: `wrapper` (host side: `partials`, `forward`, `unsupported`, the launch's
`ForwardLaunch`), one per kernel (`sm90_forward_wgmma`: the chain in the wgmma
warpgroups; `sm90_forward_ws`: the chain in a dedicated epilogue warpgroup; `sm90_fold`:
the split fold; `sm90_dz`: the backward's dz; `sm90_grad_gemm`: the backward's dh / dW
GEMMs reading and writing in place), `common` (what the kernels share: tile constants,
shard geometry, work items, the chain step, layouts, outputs), `tuning` (one frozen config
per kernel, the bucket table, bit-neutral geometry), `tile_math` / `ptx_ops` /
`ptx_programs` (the contract's per-tile arithmetic), `interpret_utils`, and `backend` (the
registry entry).
"""

from __future__ import annotations

from pallas_kernels.common import shard_geometry
from pallas_kernels.sm90_fold import fold
from pallas_kernels.tuning import BUCKETS, select_bucket
from pallas_kernels.wrapper import forward, partials, unsupported

BACKEND_NAME = "pallas_sm90"


def unavailable_reason() -> str:
    """Why this backend cannot run on the default JAX device ("" when it can)."""
    try:
        import jax

        devs = jax.devices()
    except Exception as e:
        return f"jax.devices() failed: {type(e).__name__}: {e}"
    if not devs or devs[0].platform != "gpu":
        return f"the default JAX device is {devs[0].platform if devs else 'missing'}, not a CUDA GPU"
    cc = getattr(devs[0], "compute_capability", None)
    if cc is None or str(cc).split(".")[0] != "9":
        return f"the GPU {getattr(devs[0], 'device_kind', '?')} has compute capability {cc}, not 9.x (Hopper)"
    return ""


def is_available() -> bool:
    """True if the default JAX backend has a CUDA GPU of compute capability 9.x."""
    return not unavailable_reason()


def supports(hidden, weight, weight_layout="vd") -> tuple[bool, str]:
    """(ok, reason): whether this backend accepts these operands (shapes/dtypes only);
    weight is [V, D] (weight_layout "vd" / `VD`) or [D, V] ("dv" / `DV`, read in place)."""
    why = unsupported(hidden, weight, weight_layout)
    return (why is None), (why or "ok")


__all__ = [
    "BACKEND_NAME",
    "partials",
    "fold",
    "forward",
    "is_available",
    "unavailable_reason",
    "supports",
    "shard_geometry",
    "BUCKETS",
    "select_bucket",
]
