"""The batch-invariant transformer body for Tunix's models: `tunix.patch(body="batch_invariant")`.

While patched, the model classes of the covered Tunix models run their body on the project's
batch-invariant ops (`detlogp_jax.body`), in whatever calls them: the patched vanilla sampler's
prefill and decode steps, `per_token_logps` (every learner's `compute_per_token_logps`), a
direct ``model(...)`` call. What is replaced, per covered model module (class attributes,
restored by `unpatch()`):

* ``Attention.block``: the q/k/v/o projections (Tunix's ``Einsum`` modules, weights read in
  place) through `body.einsum`; RoPE, Qwen2's q/k/v biases and Tunix's sharding constraints
  exactly as Tunix writes them; the new keys and values written into Tunix's KV cache (its
  own layout [B, S, Hkv, Dh], its own slot ``end_index``), then `body.attention` over that
  cache (no copy of it);
* ``MLP.block``: the gate / up / down ``nnx.Linear`` kernels through the same einsum, SiLU and
  the gate product as Tunix writes them;
* ``RMSNorm.__call__``: `body.rms_norm` with the module's scale, epsilon and output dtype
  (every norm: the layers', Qwen3's q/k norms, the final norm).

Embedding lookups, RoPE, the SiLU gate and the residual adds stay Tunix's own (element-wise:
a row's bytes never depend on the batch, within compiled programs; eager RoPE rounds otherwise
than its compiled form, so the integration's `per_token_logps` compiles its forward while the
body is patched, as the sampler's steps are compiled). The head is not part of the body: the
integration's `linear_logp` head computes the logits and logprobs.

Positions, padding and the cache (the part `body.attention` needs to be told). Tunix left-pads
prompts and right-pads completions, and hands each layer an attention mask [B, T, S] (causal
over cache slots, keys masked where the token is the pad id) and, for the sampler, a cache
whose slot ``end_index`` receives the step's first token. The body reads everything from that
mask and the cache's slot, never from the batch's shape:

* the key mask of sequence b is the mask's last query row (a query attends every real key up
  to its own slot, and the last query is the latest slot); ``kv_start[b]`` is its first real
  slot, so cache slot s holds position s - kv_start[b] whatever the prompt padding;
* query t sits at slot ``end_index + t`` (0 + t without a cache; the cache must not wrap
  around, which Tunix's vanilla sampler ensures by refusing more steps than slots); a query whose own key is
  masked (a pad token: left padding, right padding after the completion, a finished row's
  filler) gets position -1 and `body.attention` returns +0 for it (finite, never NaN, so
  Tunix's masks multiply finite numbers); a real query gets position ``slot - kv_start[b]``.
  It attends exactly the keys at positions 0 .. p, in blocks tied to those positions: the
  same bytes in a prefill, a chunk, a decode step or the trainer's full forward, at any batch
  size, padding or cache length. Keys of padding slots are never read for a real query.

This is Tunix's own attention for every real token of a contiguous sequence (left padding,
then the real tokens, then right padding: what the sampler produces and what
`tunix.rl.common.process_ids` builds from a left-padded prompt and a right-padded completion).
A pad id between two real tokens (a sampled pad id) is outside it: Tunix masks that key while
the body keeps it (Tunix's own sampler and trainer already give such a sequence different
positions). Packed sequences (segment ids without an attention mask) are refused.

Gradients: the body ops' backward is the plain formulation's (XLA's GEMMs, RMSNorm in jnp, the
einsum-softmax attention, in which padding queries get zero cotangents, never NaN). So a learner
differentiates through the patched body; its gradients are the usual float results, not bitwise
invariant (only the forward logprobs are the contract).

The body is validated on one device (the sampler and the trainer each unsharded); on a mesh
whose sharding splits the body's weights, the ops run as XLA partitions them, which this module
does not claim to keep invariant.

Covered: Qwen3 (dense: no experts), Qwen2, Llama3. Refused (`UnsupportedModelError` from the
integration's paths, and from the patched block for a Qwen3 MoE): Gemma3 (sliding-window local
attention layers, whose Tunix prefill mask is tied to slots rather than positions, and
query pre-attention scaling), Qwen3 with experts (the routed MoE layer), a model carrying
LoRA parameters (Qwix intercepts the einsums this body replaces), any other class.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from detlogp_jax import body as body_ops

__all__ = [
    "BODIES",
    "COVERED",
    "EXPECTED_SIGNATURES",
    "REFUSED",
    "UnsupportedModelError",
    "attention_layout",
    "check_model",
    "replacements",
]

BODIES = (None, "batch_invariant")


class UnsupportedModelError(TypeError):
    """The model is not a Tunix class the integration knows, or not one this use of it covers
    (re-exported as `detlogp_jax.integrations.tunix.UnsupportedModelError`)."""


@dataclasses.dataclass(frozen=True)
class _Family:
    name: str  # the integration's adapter name (also the key of its Attention.block builder)
    module: str
    rmsnorm: str  # "module_dtype" (Qwen: out dtype = module.dtype) | "input_dtype" (Llama3)

    def mod(self):
        return importlib.import_module(self.module)


COVERED: dict[str, _Family] = {
    "qwen3": _Family("qwen3", "tunix.models.qwen3.model", "module_dtype"),
    "qwen2": _Family("qwen2", "tunix.models.qwen2.model", "module_dtype"),
    "llama3": _Family("llama3", "tunix.models.llama3.model", "input_dtype"),
}
REFUSED = {
    "gemma3": (
        "its local layers use sliding-window attention (Tunix's prefill window mask is tied to cache "
        "slots, not positions) and it scales queries before attention; body.attention is plain causal "
        "attention over positions 0 .. p"
    ),
}
COVERED_TEXT = "Qwen3 (dense, no experts), Qwen2, Llama3"

# (module, attribute path, expected parameter names) of what the body replaces or calls.
EXPECTED_SIGNATURES = (
    (
        "tunix.models.qwen3.model",
        "Attention.block",
        ("self", "x", "segment_pos", "cache", "attn_mask", "segment_ids"),
    ),
    ("tunix.models.qwen3.model", "MLP.block", ("self", "x")),
    ("tunix.models.qwen3.model", "RMSNorm.__call__", ("self", "x")),
    ("tunix.models.qwen3.model", "apply_rope", ("inputs", "positions", "head_dim", "rope_theta")),
    ("tunix.models.qwen3.model", "shard", ("x", "s")),
    (
        "tunix.models.qwen2.model",
        "Attention.block",
        ("self", "x", "cache", "attn_mask", "sin", "cos", "segment_ids"),
    ),
    ("tunix.models.qwen2.model", "MLP.block", ("self", "x")),
    ("tunix.models.qwen2.model", "RMSNorm.__call__", ("self", "x")),
    ("tunix.models.qwen2.model", "apply_rotary_embedding", ("x", "sin", "cos")),
    ("tunix.models.qwen2.model", "shard", ("x", "s")),
    ("tunix.models.llama3.model", "Attention.block", ("self", "x", "segment_pos", "cache", "attn_mask")),
    ("tunix.models.llama3.model", "MLP.block", ("self", "x")),
    ("tunix.models.llama3.model", "RMSNorm.__call__", ("self", "x")),
    ("tunix.models.llama3.model", "apply_rope", ("inputs", "positions", "head_dim", "rope_theta")),
    ("tunix.models.llama3.model", "shard", ("x", "s")),
)


# --- the pieces of a Tunix layer ----------------------------------------------------------


def _proj(einsum_module, x, backend: str):
    """A Tunix ``Einsum`` module's product through the body: the Qwen modules cast x and w to
    their ``dtype`` (as Tunix does: a no-op when the weight is stored in it), Llama3's promote."""
    w = einsum_module.w[...]
    dt = getattr(einsum_module, "dtype", None)
    dt = jnp.promote_types(x.dtype, w.dtype) if dt is None else jnp.dtype(dt)
    return body_ops.einsum(einsum_module.einsum_str, x.astype(dt), w.astype(dt), backend=backend)


def _linear(layer: nnx.Linear, x, backend: str):
    """``nnx.Linear(x)`` through the body: flax's own dtype promotion, the kernel [in, out] read
    in place, its bias (if any) added as flax adds it."""
    kernel = layer.kernel[...]
    bias = layer.bias[...] if layer.bias is not None else None
    x, kernel, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
    y = body_ops.einsum("...k,kn->...n", x, kernel, backend=backend)
    if bias is not None:
        y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


def attention_layout(attn_mask, t: int, slot0, s_len: int):
    """(q_positions [B, T], kv_start [B]) of a Tunix attention call (module docstring):
    attn_mask [B, T, S] (True = may attend), the step's T queries at slots slot0 .. slot0 + T - 1
    of an S-slot cache (the keys)."""
    if attn_mask is None:
        raise NotImplementedError(
            "body='batch_invariant' needs Tunix's attention mask; packed sequences (segment ids without a "
            "mask) are not supported"
        )
    mask = jnp.asarray(attn_mask)
    if mask.ndim != 3 or mask.shape[1] != t or mask.shape[2] != s_len:
        raise ValueError(
            f"body='batch_invariant' expects Tunix's attention mask [B, T={t}, S={s_len}] (queries x cache "
            f"slots), got {mask.shape}"
        )
    key_valid = mask[:, -1, :].astype(bool)  # the latest query sees every real key up to its slot
    kv_start = jnp.argmax(key_valid, axis=1).astype(jnp.int32)  # the first real slot (0 if none)
    q_slots = (slot0 + jnp.arange(t, dtype=jnp.int32))[None, :]  # [1, T]
    q_real = jnp.take_along_axis(key_valid, jnp.broadcast_to(q_slots, (mask.shape[0], t)), axis=1)
    q_pos = jnp.where(q_real, q_slots - kv_start[:, None], -1).astype(jnp.int32)
    return q_pos, kv_start


def _cached_attention(q, k_new, v_new, cache, attn_mask, *, scale: float, backend: str):
    """Tunix's cache update (its layout, its slot), then `body.attention` over the cache.
    Returns (output [B, T, Hq, Dh], the new layer cache or None)."""
    t = q.shape[1]
    if cache is not None:
        s_len = cache["v"].shape[1]
        slot0 = (cache["end_index"][0] % s_len).astype(jnp.int32)
        idx = (0, slot0, 0, 0)
        v = lax.dynamic_update_slice(cache["v"], v_new, idx)
        k = lax.dynamic_update_slice(cache["k"], k_new, idx)
        new_cache = {"v": v, "k": k, "end_index": cache["end_index"] + t}
    else:
        slot0, k, v, new_cache = jnp.int32(0), k_new, v_new, None
    q_pos, kv_start = attention_layout(attn_mask, t, slot0, k.shape[1])
    out = body_ops.attention(
        q, k, v, q_positions=q_pos, kv_start=kv_start, scale=float(scale), out_dtype=v.dtype, backend=backend
    )
    return out, new_cache


def _no_experts(self):
    if getattr(self.config, "num_experts", None):
        raise UnsupportedModelError(
            f"body='batch_invariant' does not cover a Qwen3 with experts (num_experts={self.config.num_experts}: "
            f"the routed MoE layer); covered: {COVERED_TEXT}"
        )


def _rotate_attend_project(mod, self, q, k, v, cache, attn_mask, backend, rotate):
    """The common tail of the three models' ``Attention.block``: Tunix's sharding constraints,
    its rotary embedding (`rotate`), the cache update and `body.attention`, the output
    projection. Returns (new cache, outputs)."""
    q, k, v = (mod.shard(x, self.shd_config.act_btnh) for x in (q, k, v))
    qkv, new_cache = _cached_attention(rotate(q), rotate(k), v, cache, attn_mask, scale=self.scale, backend=backend)
    return new_cache, mod.shard(_proj(self.o_proj, qkv, backend), self.shd_config.act_btd)


def _qwen3_block(mod, backend):
    def block(self, x, segment_pos, cache, attn_mask, segment_ids=None):
        """Tunix 0.1.7 qwen3 ``Attention.block`` on the batch-invariant body."""
        _no_experts(self)
        q = self.q_norm(_proj(self.q_proj, x, backend))
        k = self.k_norm(_proj(self.k_proj, x, backend))
        v = _proj(self.v_proj, x, backend)
        rotate = lambda y: mod.apply_rope(y, segment_pos, head_dim=self.head_dim)  # noqa: E731
        return _rotate_attend_project(mod, self, q, k, v, cache, attn_mask, backend, rotate)

    return block


def _qwen2_block(mod, backend):
    def block(self, x, cache, attn_mask, sin, cos, segment_ids=None):
        """Tunix 0.1.7 qwen2 ``Attention.block`` on the batch-invariant body (its q / k / v biases
        added as Tunix adds them)."""
        dt = self.config.dtype

        def biased(layer, bias):
            y = _proj(layer, x, backend)
            b, t, n, h = y.shape
            return jnp.reshape(jnp.reshape(y, (b, t, n * h)) + bias[...].astype(dt), (b, t, n, h))

        q, k, v = biased(self.q_proj, self.q_bias), biased(self.k_proj, self.k_bias), biased(self.v_proj, self.v_bias)
        rotate = lambda y: mod.apply_rotary_embedding(y, sin, cos)  # noqa: E731
        return _rotate_attend_project(mod, self, q, k, v, cache, attn_mask, backend, rotate)

    return block


def _llama3_block(mod, backend):
    def block(self, x, segment_pos, cache, attn_mask):
        """Tunix 0.1.7 llama3 ``Attention.block`` on the batch-invariant body."""
        q, k, v = (_proj(layer, x, backend) for layer in (self.q_proj, self.k_proj, self.v_proj))
        rotate = lambda y: mod.apply_rope(y, segment_pos, head_dim=self.head_dim)  # noqa: E731
        return _rotate_attend_project(mod, self, q, k, v, cache, attn_mask, backend, rotate)

    return block


_BLOCKS = {"qwen3": _qwen3_block, "qwen2": _qwen2_block, "llama3": _llama3_block}


def _mlp_block(mod, backend):
    def block(self, x):
        """Tunix 0.1.7 ``MLP.block`` (Qwen3, Qwen2, Llama3) on the batch-invariant body."""
        activations = nnx.silu(_linear(self.gate_proj, x, backend)) * _linear(self.up_proj, x, backend)
        activations = mod.shard(activations, self.shd_config.act_btf)
        return _linear(self.down_proj, activations, backend)

    return block


def _rms_norm_call(family: _Family):
    def __call__(self, x):
        """Tunix 0.1.7 ``RMSNorm`` on `body.rms_norm` (same scale, epsilon and output dtype)."""
        out = jnp.dtype(self.dtype) if family.rmsnorm == "module_dtype" else jnp.dtype(x.dtype)
        return body_ops.rms_norm(x, self.w[...], float(self.norm_eps), out_dtype=out)

    return __call__


def replacements(backend: str) -> list[tuple[Any, str, Callable]]:
    """[(class, attribute, replacement)] of every covered model module: what `patch()` sets
    (and `unpatch()` restores) for body="batch_invariant" with `body_backend=backend`."""
    out = []
    for family in COVERED.values():
        mod = family.mod()
        out.append((mod.Attention, "block", _BLOCKS[family.name](mod, backend)))
        out.append((mod.MLP, "block", _mlp_block(mod, backend)))
        out.append((mod.RMSNorm, "__call__", _rms_norm_call(family)))
    return out


def check_model(model, adapter_name: str) -> None:
    """Refuses (`UnsupportedModelError`) a model the batch-invariant body does not cover: a class
    outside `COVERED`, a Qwen3 with experts, a layer whose attention / MLP / norm is not the
    module's own class (what the patch replaces), or LoRA parameters."""
    if adapter_name not in COVERED:
        why = REFUSED.get(adapter_name, "its layers are not ones this body replaces")
        raise UnsupportedModelError(
            f"body='batch_invariant' does not cover {type(model).__name__}: {why}; covered: {COVERED_TEXT} "
            "(patch(body=None) keeps Tunix's own body)"
        )
    family = COVERED[adapter_name]
    mod = family.mod()
    _no_experts(model)
    expect = (
        ("attn", mod.Attention),
        ("mlp", mod.MLP),
        ("input_layernorm", mod.RMSNorm),
        ("post_attention_layernorm", mod.RMSNorm),
    )
    for i, layer in enumerate(model.layers):
        for name, cls in expect:
            got = getattr(layer, name, None)
            if type(got) is not cls:
                raise UnsupportedModelError(
                    f"body='batch_invariant': layer {i}'s {name} is {type(got).__name__}, not "
                    f"{family.module}.{cls.__name__} (the class the patch replaces)"
                )
    if type(model.final_norm) is not mod.RMSNorm:
        raise UnsupportedModelError(f"body='batch_invariant': the final norm is {type(model.final_norm).__name__}")
    if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        raise UnsupportedModelError(
            "body='batch_invariant' does not cover a model with LoRA parameters: Qwix adds the adapters by "
            "intercepting the einsums and nnx.Linear calls that the body replaces"
        )
