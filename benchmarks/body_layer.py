"""A transformer layer stack for the body benchmark (`python -m benchmarks.body --ops layer`).

Qwen3-8B's layer shapes (D = 4096, 32 query heads and 8 KV heads of 128, SwiGLU of 12288, RMSNorm
on the residual stream and on q / k, RoPE), random weights at the real sizes, `n_layers` of them,
in two bodies on the same weights:

* "ours": every projection `body.matmul` (W [K, N] read in place), attention `body.attention`
  over the KV cache, the norms `body.rms_norm` (backend: the runner's --backend);
* "xla": the same layer in plain jnp (`jnp.dot`, einsum + softmax, jnp RMSNorm): what a Flax /
  Tunix model runs today.

`decode_step(params, x, caches, pos)`: one token per sequence at position `pos` [B] over caches
[L, B, S, Hkv, Dh] (written at `pos`); `prefill(params, x)`: [B, T, D] causal over its own keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from detlogp_jax import body

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LayerShape:
    d: int
    hq: int
    hkv: int
    dh: int
    ff: int
    n_layers: int


SHAPES = {
    "qwen3_8b": LayerShape(d=4096, hq=32, hkv=8, dh=128, ff=12288, n_layers=4),
    "tiny": LayerShape(d=128, hq=4, hkv=2, dh=64, ff=256, n_layers=2),
}


def init_params(shape: LayerShape, seed: int = 0) -> list[dict]:
    """Random bf16 weights of `n_layers` layers (scaled by 1 / sqrt(fan-in))."""
    s = shape
    dims = {
        "q": (s.d, s.hq * s.dh),
        "k": (s.d, s.hkv * s.dh),
        "v": (s.d, s.hkv * s.dh),
        "o": (s.hq * s.dh, s.d),
        "gate": (s.d, s.ff),
        "up": (s.d, s.ff),
        "down": (s.ff, s.d),
    }
    layers = []
    for i in range(s.n_layers):
        keys = jax.random.split(jax.random.key(seed * 100 + i), len(dims))
        p = {
            n: (jax.random.normal(k, kn, F32) / np.sqrt(kn[0])).astype(jnp.bfloat16)
            for k, (n, kn) in zip(keys, dims.items())
        }
        p |= {n: jnp.ones((w,), jnp.bfloat16) for n, w in (("ln1", s.d), ("ln2", s.d), ("qn", s.dh), ("kn", s.dh))}
        layers.append(p)
    return layers


def _rope(x, positions, theta: float = 1_000_000.0):
    """RoPE as Qwen3 writes it in plain jnp (element-wise: invariant as XLA builds it)."""
    dh = x.shape[-1]
    timescale = theta ** (2 * jnp.arange(dh // 2) / dh)
    inp = (positions[..., None] / timescale)[..., None, :]
    sin, cos = jnp.sin(inp), jnp.cos(inp)
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


class _Ops:
    def __init__(self, lane: str, backend: str):
        self.ours, self.backend = lane == "ours", backend

    def dense(self, x, w):
        return body.matmul(x, w, backend=self.backend) if self.ours else jnp.dot(x, w)

    def norm(self, x, scale):
        if self.ours:
            return body.rms_norm(x, scale)
        xf = x.astype(F32)
        return (xf * (jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * scale.astype(F32))).astype(x.dtype)

    def attend(self, q, k, v, q_positions):
        backend = self.backend if self.ours else "xla"
        return body.attention(q, k, v, q_positions=q_positions, backend=backend)


def _layer(ops: _Ops, p: dict, s: LayerShape, x, positions, k_cache=None, v_cache=None):
    """One layer on x [B, T, D] at positions [B, T]; with caches, the new keys / values are
    written at `positions` (decode: T = 1) and attention reads the whole cache."""
    b, t, _ = x.shape
    h = ops.norm(x, p["ln1"])
    q = ops.norm(ops.dense(h, p["q"]).reshape(b, t, s.hq, s.dh), p["qn"])
    k = ops.norm(ops.dense(h, p["k"]).reshape(b, t, s.hkv, s.dh), p["kn"])
    v = ops.dense(h, p["v"]).reshape(b, t, s.hkv, s.dh)
    q, k = _rope(q, positions), _rope(k, positions)
    if k_cache is not None:
        rows = jnp.arange(b)
        k_cache = k_cache.at[rows, positions[:, 0]].set(k[:, 0])
        v_cache = v_cache.at[rows, positions[:, 0]].set(v[:, 0])
        k, v = k_cache, v_cache
    a = ops.attend(q, k, v, positions)
    x = x + ops.dense(a.reshape(b, t, s.hq * s.dh), p["o"])
    h = ops.norm(x, p["ln2"])
    x = x + ops.dense(jax.nn.silu(ops.dense(h, p["gate"])) * ops.dense(h, p["up"]), p["down"])
    return x, k_cache, v_cache


def prefill(lane: str, backend: str, shape: LayerShape):
    """fn(params, x [B, T, D]) -> x after the stack (causal over each sequence's own keys)."""
    ops = _Ops(lane, backend)

    def fn(params, x):
        pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        for p in params:
            x, _, _ = _layer(ops, p, shape, x, pos)
        return x

    return fn


def decode_step(lane: str, backend: str, shape: LayerShape):
    """fn(params, x [B, 1, D], k_caches, v_caches [L, B, S, Hkv, Dh], pos [B]) -> (x, caches)."""
    ops = _Ops(lane, backend)

    def fn(params, x, k_caches, v_caches, pos):
        ks, vs = [], []
        for i, p in enumerate(params):
            x, k, v = _layer(ops, p, shape, x, pos[:, None], k_caches[i], v_caches[i])
            ks.append(k)
            vs.append(v)
        return x, jnp.stack(ks), jnp.stack(vs)

    return fn


def trainer_fwd_bwd(lane: str, backend: str, shape: LayerShape):
    """fn(params, x) -> the gradient of sum(prefill(x) ** 2) w.r.t. the parameters (the scoring
    pass of a trainer: the invariant forward, the plain backward)."""
    fwd = prefill(lane, backend, shape)
    return jax.grad(lambda params, x: jnp.sum(jnp.square(fwd(params, x).astype(F32))))
