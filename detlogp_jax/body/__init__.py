"""The batch-invariant transformer body: ops whose row bytes never depend on the batch.

`matmul(x, w)` / `einsum(spec, x, w)`: the projections (q/k/v/o, gate/up/down) with one f32
accumulator per element and one fixed ascending K order (`detlogp_jax.body.gemm`).
`attention(q, k, v, q_positions=...)`: causal GQA attention over a KV cache whose query rows
have the same bytes in a prefill, a chunk of one or a decode step (`detlogp_jax.body.kv_attention`).
`rms_norm(x, scale)`: RMSNorm with a pinned reduction (`detlogp_jax.body.norm`).
Backends are chosen by name through `detlogp_jax.body.backends` ("auto", "reference",
"pallas_sm90", "xla"), under the operator's strict mode (`detlogp_jax.strict_mode()`).
"""

from detlogp_jax.backends import BackendUnavailableError, StrictModeError, strict_mode
from detlogp_jax.body import backends
from detlogp_jax.body.backends import BodyBackend
from detlogp_jax.body.gemm import einsum, matmul
from detlogp_jax.body.kv_attention import attention
from detlogp_jax.body.norm import rms_norm

__all__ = [
    "BackendUnavailableError",
    "attention",
    "BodyBackend",
    "StrictModeError",
    "backends",
    "einsum",
    "matmul",
    "rms_norm",
    "strict_mode",
]
