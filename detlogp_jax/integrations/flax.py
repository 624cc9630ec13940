"""Flax NNX integration: `LogpHead`, an lm_head whose output is `linear_logp`.

`LogpHead` holds the lm_head weight [V, D] in the lm_head layout (an
`nnx.Param`, optionally a bias [V]), or reuses the embedding table of a tied
`nnx.Embed` ([V, D] already), and routes `__call__(hidden, targets)` to
`detlogp_jax.linear_logp`, so logp/lse of the chosen tokens come out without a
materialized [N, V] buffer (unless `return_logits=True`). It is a plain NNX
module: it works under `nnx.jit`, `nnx.grad`/`nnx.value_and_grad` and with
`nnx.Optimizer` (the op has a chunked custom VJP for hidden, weight and bias).

With `mesh=` and `tp_axis=` the weight rows are sharded over the mesh axis
(vocab-parallel) and calls go to the tensor-parallel entry
`sharding.linear_logp_tp`.

An integration: it stands above the op core and reaches `sharding` by name
(`detlogp_jax.plugins.tensor_parallel`). `detlogp_jax.flax`
is its short name. This file is named ``flax.py``: it imports the real Flax
with absolute imports (``from flax import nnx``), which resolve to the
top-level package because Python 3 imports are absolute.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from detlogp_jax import api, inputs, plugins
from detlogp_jax import contract as C
from detlogp_jax.api import LogpOutput

__all__ = ["LogpHead", "LogpOutput", "masked_mean_nll"]


def masked_mean_nll(logp, targets):
    """-mean(logp) over targets != ignore_index (0.0 when every target is ignored)."""
    live = (targets != C.IGNORE_INDEX).astype(jnp.float32)
    return -jnp.sum(logp * live) / jnp.maximum(jnp.sum(live), 1.0)


class LogpHead(nnx.Module):
    """lm_head + contract log-probabilities of chosen tokens.

    Args:
      in_features: hidden size D (optional with `tied_embedding`).
      vocab_size: real vocabulary V (optional with `tied_embedding`: its rows).
      padded_vocab_size: the canonical padded vocabulary that fixes the
        contract's split structure; default `canonical_padded_vocab(vocab_size)`
        (rollout and trainer must agree on it). The weight holds `vocab_size`
        rows unless `pad_weight=True` (then `padded_vocab_size` rows, zero
        padding rows: needed to shard the vocab evenly over a TP mesh).
      use_bias: add a learned bias [rows] (FP32 add, per the contract).
      weight_layout: the layout of an own weight: "vd" ([rows, D], the lm_head
        layout) or "dv" ([D, rows], like `nnx.Linear(D, V).kernel`). The op
        reads either in place with the same bytes.
      tied_embedding: an `nnx.Embed` whose embedding [V, D] is the weight
        (shared, so gradients from both uses accumulate into one Param).
      linear: an existing `nnx.Linear(D, V)` whose kernel [D, V] (and bias, if
        it has one) is the head, read in place ("dv"; shared Params, e.g. the
        lm_head of a Flax model that is not tied).
      backend: "auto" | "reference" | "pallas_sm90" | "xla".
      param_dtype: dtype of the weight/bias Params (ignored when tied).
      dtype: compute dtype of hidden and weight for the op (default: the
        weight's dtype); the op needs both in one float dtype.
      kernel_init / bias_init: initializers (kernel in `weight_layout`, fan_in = D).
      mesh / tp_axis: shard weight rows over `mesh` axis `tp_axis` and route
        to `sharding.linear_logp_tp`.
      checked: forwarded to `linear_logp` (raise on out-of-range targets).
      residuals: what the forward keeps for the backward (`linear_logp`): "recompute"
        (default) or "logits" (its FP32 logits [N, V]: no recompute GEMM in the
        backward, O(N * V) memory); a call may override it.
      rngs: `nnx.Rngs` (needs a `params` stream; unused when tied w/o bias).
    """

    def __init__(
        self,
        in_features: int | None = None,
        vocab_size: int | None = None,
        *,
        padded_vocab_size: int | None = None,
        pad_weight: bool | None = None,
        use_bias: bool = False,
        tied_embedding: nnx.Embed | None = None,
        linear: nnx.Linear | None = None,
        weight_layout: str = "vd",
        backend: str = "auto",
        param_dtype: Any = jnp.float32,
        dtype: Any = None,
        kernel_init: nnx.Initializer | None = None,
        bias_init: nnx.Initializer = nnx.initializers.zeros_init(),
        mesh: jax.sharding.Mesh | None = None,
        tp_axis: str | None = None,
        checked: bool | None = None,
        residuals: str = "recompute",
        rngs: nnx.Rngs | None = None,
    ):
        inputs.check_residuals(residuals)
        if (mesh is None) != (tp_axis is None):
            raise ValueError("mesh and tp_axis go together (both or neither)")
        if weight_layout not in ("vd", "dv"):
            raise ValueError(f"weight_layout must be 'vd' or 'dv', got {weight_layout!r}")
        if tied_embedding is not None and linear is not None:
            raise ValueError("give tied_embedding or linear, not both")
        if linear is not None:
            if not isinstance(linear, nnx.Linear):
                raise TypeError(f"linear must be an nnx.Linear, got {type(linear).__name__}")
            d, cols = linear.kernel.shape
            if in_features is not None and in_features != d:
                raise ValueError(f"in_features {in_features} != the linear layer's in_features {d}")
            vocab_size = cols if vocab_size is None else int(vocab_size)
            if vocab_size > cols:
                raise ValueError(f"vocab_size {vocab_size} exceeds the linear layer's {cols} outputs")
            if use_bias and linear.bias is None:
                raise ValueError("use_bias=True but the linear layer has no bias")
            in_features, weight_layout = d, "dv"
        if tied_embedding is not None:
            weight_layout = "vd"
            if not isinstance(tied_embedding, nnx.Embed):
                raise TypeError(f"tied_embedding must be an nnx.Embed, got {type(tied_embedding).__name__}")
            rows, d = tied_embedding.embedding.shape
            if in_features is not None and in_features != d:
                raise ValueError(f"in_features {in_features} != tied embedding features {d}")
            vocab_size = rows if vocab_size is None else int(vocab_size)
            if vocab_size > rows:
                raise ValueError(f"vocab_size {vocab_size} exceeds the tied embedding's {rows} rows")
            in_features = d
        if in_features is None or vocab_size is None:
            raise ValueError("in_features and vocab_size are required without tied_embedding")
        self.in_features = int(in_features)
        self.vocab_size = int(vocab_size)
        self.padded_vocab_size = int(
            C.canonical_padded_vocab(self.vocab_size) if padded_vocab_size is None else padded_vocab_size
        )
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} < vocab_size {self.vocab_size}")
        if pad_weight is None:
            pad_weight = mesh is not None and tied_embedding is None
        self.backend = backend
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.checked = checked
        self.residuals = residuals
        self.mesh = mesh
        self.tp_axis = tp_axis
        self.tied = tied_embedding is not None
        self.wraps_linear = linear is not None
        self.weight_layout = weight_layout
        vocab_spec = (tp_axis, None) if weight_layout == "vd" else (None, tp_axis)

        if self.tied:
            self.embed = tied_embedding
            rows = tied_embedding.embedding.shape[0]
        elif self.wraps_linear:
            self.linear = linear
            rows = linear.kernel.shape[1]
        else:
            if rngs is None:
                raise ValueError("rngs is required to initialise an untied LogpHead")
            rows = self.padded_vocab_size if pad_weight else self.vocab_size
            d_axis = 1 if weight_layout == "vd" else 0
            init = kernel_init or nnx.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal", in_axis=d_axis, out_axis=1 - d_axis
            )
            shape = (rows, self.in_features) if weight_layout == "vd" else (self.in_features, rows)
            w = init(rngs.params(), shape, jnp.dtype(param_dtype))
            if rows > self.vocab_size:  # padding rows are never read by the op; keep them zero
                w = w.at[self.vocab_size :].set(0) if weight_layout == "vd" else w.at[:, self.vocab_size :].set(0)
            self.weight = nnx.Param(self._place(w, vocab_spec))
        self.rows = int(rows)
        if self.wraps_linear:
            self.bias = linear.bias if use_bias or linear.bias is not None else None
        elif use_bias:
            if rngs is None:
                raise ValueError("rngs is required to initialise the bias")
            b = bias_init(rngs.params(), (self.rows,), jnp.dtype(param_dtype))
            self.bias = nnx.Param(self._place(b, (tp_axis,)))
        else:
            self.bias = None

    # -- helpers -------------------------------------------------------------------
    def _place(self, x, spec):
        if self.mesh is None:
            return x
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))
        return jax.device_put(x, sharding)

    @property
    def kernel(self) -> nnx.Param:
        """The weight Param in `weight_layout` ([rows, D] or [D, rows]; the tied
        embedding's or the wrapped linear layer's when shared)."""
        if self.tied:
            return self.embed.embedding
        return self.linear.kernel if self.wraps_linear else self.weight

    def arrays(self):
        """(weight, bias|None) as arrays, the weight in the compute dtype."""
        w = self.kernel[...]
        if self.dtype is not None and w.dtype != self.dtype:
            w = w.astype(self.dtype)
        b = None if self.bias is None else self.bias[...]
        return w, b

    def fingerprint(self) -> str:
        """`weight_fingerprint` of the weight (as used by the op) and bias."""
        from detlogp_jax.fingerprint import weight_fingerprint

        w, b = self.arrays()
        return weight_fingerprint(w if self.weight_layout == "vd" else w.T, b)

    # -- forward -------------------------------------------------------------------
    def __call__(
        self,
        hidden,
        targets,
        *,
        temperature=1.0,
        return_logits: bool = False,
        backend: str | None = None,
        return_entropy: bool = False,
        residuals: str | None = None,
    ) -> LogpOutput:
        """LogpOutput(logp, lse, logits|None, provenance, entropy|None) of `targets` under this head.

        hidden [..., D] (cast to the compute dtype), targets [...] int
        (-100 = ignore). `backend` overrides the module's backend for one call.
        return_entropy: also the per-row entropy of softmax(logits / T) over the real
        vocabulary (`linear-logp-entropy-v1`; differentiable, e.g. for an entropy bonus).
        residuals: overrides the module's residual mode for one call ("recompute" | "logits").
        """
        w, b = self.arrays()
        if hidden.dtype != w.dtype:
            hidden = hidden.astype(w.dtype)
        kw = dict(
            bias=b,
            temperature=temperature,
            vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab_size,
            return_logits=return_logits,
            backend=self.backend if backend is None else backend,
            weight_layout=self.weight_layout,
            return_entropy=return_entropy,
            residuals=self.residuals if residuals is None else residuals,
        )
        if self.mesh is not None and kw["backend"] != "xla":  # the XLA lane has no TP form: it runs unsharded
            tp = plugins.tensor_parallel()
            out = tp.linear_logp_tp(
                hidden, w, targets, mesh=self.mesh, tp_axis=self.tp_axis, checked=self.checked, **kw
            )
            if out.logits is not None and out.logits.shape[-1] != self.vocab_size:
                out = out._replace(logits=out.logits[..., : self.vocab_size])  # same layout as linear_logp
            return out
        return api.linear_logp(hidden, w, targets, checked=self.checked, **kw)

    def logits(self, hidden, *, backend: str | None = None):
        """FP32 unscaled logits [..., vocab_size] from the op's serving entry."""
        targets = jnp.full(hidden.shape[:-1], C.IGNORE_INDEX, jnp.int32)
        return self(hidden, targets, return_logits=True, backend=backend).logits

    def loss(self, hidden, targets, *, temperature=1.0, backend: str | None = None):
        """-mean logp over non-ignored targets (scalar f32)."""
        out = self(hidden, targets, temperature=temperature, backend=backend)
        return masked_mean_nll(out.logp, targets)
