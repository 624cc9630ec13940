"""A small Flax NNX decoder LM whose loss head is `LogpHead`.

Token + learned position embeddings, `n_layers` pre-norm blocks (causal
multi-head attention + SwiGLU MLP, RMSNorm), a final RMSNorm and a `LogpHead`.
Two ways to get final hidden states:

* `hidden(tokens)`: the trainer's teacher-forced full-sequence forward
  ([B, L] -> [B, L, D], causal, all positions at once);
* `decode(token, pos, cache)`: the rollout's one-token step against a KV cache
  ([B] -> [B, D]); `init_cache(batch)` makes the cache.

Both compute the same function. With the plain body (`body="xla"`: Flax's
layers, XLA's GEMMs and an einsum softmax) their bytes need not match (other GEMM
and attention shapes), which is exactly what the parity validation
(`detlogp_jax.apps.parity`) attributes to the body. With `body="batch_invariant"`
every projection is `detlogp_jax.body.matmul`, attention is
`detlogp_jax.body.attention` over the cache, the norms are `body.rms_norm` and
the rest is element-wise, so a decode step and the full-sequence forward give
the same hidden-state bytes at any batch size. The body is chosen per call (the
parameters are the same); `body_backend` picks the invariant ops' backend
("auto": the Hopper kernels where they serve, else the reference). An
application above the op core, for tests and the validator only; not a real
model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from detlogp_jax import body as body_ops
from detlogp_jax import contract as C
from detlogp_jax.flax import LogpHead, masked_mean_nll

__all__ = ["BODIES", "ToyLMConfig", "ToyLM"]

BODIES = ("xla", "batch_invariant")


@dataclasses.dataclass(frozen=True)
class ToyLMConfig:
    vocab_size: int = 512
    padded_vocab_size: int | None = None  # default: canonical_padded_vocab(vocab_size)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    max_len: int = 128
    dtype: Any = jnp.float32  # params and compute
    tie_embeddings: bool = False
    head_bias: bool = False
    backend: str = "auto"
    body: str = "xla"  # the default body of a call: "xla" or "batch_invariant" (module docstring)
    body_backend: str = "auto"  # the invariant body ops' backend

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _dense(d_in, d_out, cfg, rngs):
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)


def _attend(q, k, v, mask, dtype):
    """q [B, Lq, H, Dh], k/v [B, Lk, H, Dh], mask [B|1, Lq, Lk] -> [B, Lq, H, Dh]."""
    scale = 1.0 / (q.shape[-1] ** 0.5)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(dtype), v, preferred_element_type=jnp.float32).astype(dtype)


class _Ops:
    """The body's layers for one call: Flax / XLA ("xla") or the invariant ops."""

    def __init__(self, body: str, backend: str):
        if body not in BODIES:
            raise ValueError(f"body must be one of {BODIES}, got {body!r}")
        self.invariant = body == "batch_invariant"
        self.backend = backend

    def dense(self, layer: nnx.Linear, x):
        if not self.invariant:
            return layer(x)
        return body_ops.matmul(x, layer.kernel[...], w_layout="kn", backend=self.backend)

    def norm(self, layer: nnx.RMSNorm, x):
        if not self.invariant:
            return layer(x)
        return body_ops.rms_norm(x, layer.scale[...], layer.epsilon)

    def attend(self, q, k, v, q_positions, dtype):
        """Causal attention of q [B, T, H, Dh] at q_positions [B, T] over k, v [B, S, H, Dh]."""
        if self.invariant:
            return body_ops.attention(q, k, v, q_positions=q_positions, backend=self.backend)
        mask = jnp.arange(k.shape[1])[None, None, :] <= q_positions[:, :, None]
        return _attend(q, k, v, mask, dtype)


class Block(nnx.Module):
    def __init__(self, cfg: ToyLMConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.cfg = cfg
        self.ln1 = nnx.RMSNorm(d, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.q = _dense(d, d, cfg, rngs)
        self.k = _dense(d, d, cfg, rngs)
        self.v = _dense(d, d, cfg, rngs)
        self.o = _dense(d, d, cfg, rngs)
        self.ln2 = nnx.RMSNorm(d, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.gate = _dense(d, f, cfg, rngs)
        self.up = _dense(d, f, cfg, rngs)
        self.down = _dense(f, d, cfg, rngs)

    def _heads(self, x):
        return x.reshape(x.shape[:-1] + (self.cfg.n_heads, self.cfg.head_dim))

    def _qkv(self, ops: _Ops, x):
        h = ops.norm(self.ln1, x)
        return (self._heads(ops.dense(layer, h)) for layer in (self.q, self.k, self.v))

    def _out_and_mlp(self, ops: _Ops, x, a):
        x = x + ops.dense(self.o, a.reshape(x.shape))
        h = ops.norm(self.ln2, x)
        return x + ops.dense(self.down, jax.nn.silu(ops.dense(self.gate, h)) * ops.dense(self.up, h))

    def __call__(self, x, ops: _Ops):
        """Full-sequence causal forward: x [B, L, D]."""
        q, k, v = self._qkv(ops, x)
        pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        return self._out_and_mlp(ops, x, ops.attend(q, k, v, pos, x.dtype))

    def decode(self, x, pos, k_cache, v_cache, ops: _Ops):
        """One step: x [B, 1, D] at position `pos`; caches [B, max_len, H, Dh]."""
        q, k, v = self._qkv(ops, x)
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), pos, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), pos, axis=1)
        q_pos = jnp.full(x.shape[:2], pos, jnp.int32)
        return self._out_and_mlp(ops, x, ops.attend(q, k_cache, v_cache, q_pos, x.dtype)), k_cache, v_cache


class ToyLM(nnx.Module):
    def __init__(self, cfg: ToyLMConfig, *, rngs: nnx.Rngs, head_kwargs: dict | None = None):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.pos = nnx.Embed(cfg.max_len, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        kw = dict(
            padded_vocab_size=cfg.padded_vocab_size,
            use_bias=cfg.head_bias,
            backend=cfg.backend,
            param_dtype=cfg.dtype,
            rngs=rngs,
        )
        kw.update(head_kwargs or {})
        if cfg.tie_embeddings:
            self.head = LogpHead(tied_embedding=self.embed, vocab_size=cfg.vocab_size, **kw)
        else:
            self.head = LogpHead(cfg.d_model, cfg.vocab_size, **kw)

    def _ops(self, body: str | None) -> _Ops:
        return _Ops(self.cfg.body if body is None else body, self.cfg.body_backend)

    # -- trainer: full sequence ------------------------------------------------------
    def hidden(self, tokens, *, body: str | None = None):
        """Final (normed) hidden states [B, L, D] of a causal full-sequence forward
        (body: "xla" or "batch_invariant"; default: the config's)."""
        ops = self._ops(body)
        L = tokens.shape[1]
        x = self.embed(tokens) + self.pos(jnp.arange(L))[None]
        for blk in self.blocks:
            x = blk(x, ops)
        return ops.norm(self.norm, x)

    def __call__(self, tokens, targets, *, temperature=1.0, return_logits=False, backend=None):
        """LogpOutput of targets [B, L] given tokens [B, L] (teacher forced)."""
        return self.head(
            self.hidden(tokens), targets, temperature=temperature, return_logits=return_logits, backend=backend
        )

    def loss(self, tokens, targets, *, temperature=1.0):
        """-mean logp over targets != -100."""
        out = self(tokens, targets, temperature=temperature)
        return masked_mean_nll(out.logp, targets)

    # -- rollout: one token per step ---------------------------------------------------
    def init_cache(self, batch: int):
        cfg = self.cfg
        shape = (cfg.n_layers, batch, cfg.max_len, cfg.n_heads, cfg.head_dim)
        return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}

    def decode(self, token, pos, cache, *, body: str | None = None):
        """token [B] int at position `pos` (scalar) -> (hidden [B, D], cache)."""
        ops = self._ops(body)
        x = self.embed(token[:, None]) + self.pos(jnp.reshape(pos, (1,)))[None]
        ks, vs = [], []
        for i, blk in enumerate(self.blocks):
            x, k, v = blk.decode(x, pos, cache["k"][i], cache["v"][i], ops)
            ks.append(k)
            vs.append(v)
        return ops.norm(self.norm, x)[:, 0], {"k": jnp.stack(ks), "v": jnp.stack(vs)}


def shifted_targets(tokens, prompt_len: int = 0):
    """Next-token targets [B, L] for tokens [B, L]: tokens[:, 1:], last = ignore.

    Targets of positions before `prompt_len - 1` are ignored too (prompt)."""
    t = jnp.concatenate([tokens[:, 1:], jnp.full((tokens.shape[0], 1), C.IGNORE_INDEX, tokens.dtype)], axis=1)
    if prompt_len > 1:
        t = t.at[:, : prompt_len - 1].set(C.IGNORE_INDEX)
    return t
