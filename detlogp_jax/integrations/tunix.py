"""Tunix integration: Tunix's per-token logprobs through `linear_logp`, trainer and sampler alike.

Tunix (google-tunix, an optional extra: ``pip install "detlogp-jax[tunix]"``) computes RL
logprobs by running the whole model, lm_head included, to FP32 logits [B, L, V] and taking a
log-softmax (`tunix.rl.common.compute_per_token_logps`); its vanilla sampler records the
sampled token's log-softmax of the step's logits. This module computes the same numbers from
the model's final hidden states and its lm_head weight, read in place, through
`detlogp_jax.linear_logp` (or `sharding.linear_logp_tp` when the head is vocab-sharded on a
mesh), with no [B, L, V] intermediate:

* `per_token_logps(model, prompt_tokens, completion_tokens, pad_id=, eos_id=, temperature=)`:
  the semantics of Tunix's `compute_per_token_logps` (same shapes, shift, masks, positions,
  temperature rule and packed-sequence mode), differentiable.
* Sampler side: `head_logits(model, hidden)` (FP32 logits from the op's serving entry, what
  the patched sampler draws from) and `token_logps(model, hidden, tokens, temperature=)` (the
  op's logp of the sampled tokens, what it records). The trainer's `per_token_logps` calls the
  same `token_logps`, so for the same hidden states the rollout-recorded and the trainer
  logprobs are the same bytes (the op is batch-invariant). `head_fingerprint` /
  `rollout_record` / `check_weight_version` tie both to one weight version.
* `patch()` / `unpatch()`: route a Tunix RL learner (actor, reference and old/rollout
  logprobs: every caller of `tunix.rl.common.compute_per_token_logps`) and the vanilla
  sampler (`tunix.generate.sampler.Sampler`) through the functions above.
* `patch(body="batch_invariant", body_backend="auto")`: also run the models' transformer body
  on the project's batch-invariant ops (`detlogp_jax.body`; the model classes' attention, MLP
  and norm methods, `detlogp_jax.integrations.tunix_body`). The op head makes the logprob a
  function of the final hidden state only; the body makes that hidden state a function of the
  token's own sequence only. Together: the logprob the patched sampler records for a
  generated token (prefill or decode step, any batch, prompt padding or cache length) equals,
  bit for bit, the trainer's `per_token_logps` of the same (prompt, completion) in a batch of
  another size, order and padding. Each sequence's first real cache slot (``kv_start``) and
  its positions are read from Tunix's attention mask and cache slot; padding queries run at
  position -1 (+0 out, never NaN); Tunix's KV cache is used in its own layout. Covered:
  Qwen3 (dense), Qwen2, Llama3; Gemma3 (sliding-window layers), a Qwen3 with experts, LoRA
  and packed sequences are refused. The body ops' backward is their plain jnp formula (the
  learner differentiates through them; gradients are not bitwise invariant). Validated on one
  device: a body whose weights are sharded over a mesh runs as XLA partitions it.

How the hidden states are obtained: the model's own ``__call__`` runs with its lm_head
replaced, for that call only and on a merged copy of the model, by an identity (the untied
``model.lm_head`` Einsum [D, V], or the tied ``model.embedder.decode`` over the embedding table
[V, D]). Everything else the model does on the way (embedding, RoPE, masks, segment ids,
remat, images, Qwix LoRA interception of the body) is unchanged. The per-model facts (where
the head is, whether it is tied, which dtype Tunix's head computes in) are one table,
`ADAPTERS`: Qwen3, Qwen2, Llama3 and Gemma3. Any other model class is refused
(`UnsupportedModelError`), as is a model with final logit soft-capping (a tanh after the
lm_head that `linear_logp` cannot apply; Tunix's Gemma3 has none) or a LoRA-adapted head.

Numerics vs Tunix's own path: in float32 the two agree to rounding (~1e-6; Tunix divides the
logits by T where the contract multiplies by fl(1/T)). With a bf16 model Tunix's lm_head
writes bf16 logits before its FP32 log-softmax; the op keeps the FP32 accumulator, so the op's
values are the more exact ones and the two differ by about the bf16 rounding of the logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from detlogp_jax import api, inputs, plugins
from detlogp_jax import contract as C
from detlogp_jax import fingerprint as fp_lib
from detlogp_jax.body import backends as body_backends
from detlogp_jax.integrations import tunix_body
from detlogp_jax.integrations.tunix_body import UnsupportedModelError

__all__ = [
    "ADAPTERS",
    "BODIES",
    "SUPPORTED_TUNIX_VERSIONS",
    "ModelAdapter",
    "OpOptions",
    "RolloutRecord",
    "TunixVersionError",
    "UnsupportedModelError",
    "TokenEntropy",
    "adapter_for",
    "check_tunix",
    "check_weight_version",
    "compute_per_token_logps_fn",
    "head_fingerprint",
    "head_logits",
    "head_weight",
    "hidden_states",
    "is_patched",
    "patch",
    "per_token_logps",
    "rollout_record",
    "token_logps",
    "tunix_version",
    "unpatch",
]

# Tunix versions whose replaced functions this module mirrors (checked by `patch()`).
SUPPORTED_TUNIX_VERSIONS = ("0.1.7",)
BODIES = tunix_body.BODIES  # patch(body=...): None (Tunix's own body) or "batch_invariant"


class TunixVersionError(RuntimeError):
    """The installed Tunix is not one whose functions `patch()` knows how to replace."""


# --- per-model adapters ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelAdapter:
    """What this integration needs to know about one Tunix model class.

    Every class here keeps its untied head as ``model.lm_head`` (an Einsum 'BTD,DV->BTV' whose
    Param ``w`` is the [D, V] kernel: weight_layout="dv") and its tied head as
    ``model.embedder.decode`` over ``model.embedder.input_embedding`` [V, D]
    (weight_layout="vd"); ``__call__(tokens, positions, cache, attention_mask, ...)`` returns
    ``(logits, cache)``.

    head_dtype: the dtype Tunix's head computes in: "module" (the head module's ``dtype``
    attribute: the Qwen Einsum/Embedder cast both operands to it) or "promote" (plain
    ``jnp.einsum``/``jnp.dot`` type promotion of hidden and weight: Llama3, Gemma3).
    """

    name: str
    module: str
    class_name: str
    tied: Callable[[Any], bool]
    head_dtype: str

    def model_class(self):
        return getattr(importlib.import_module(self.module), self.class_name)


ADAPTERS: tuple[ModelAdapter, ...] = (
    ModelAdapter("qwen3", "tunix.models.qwen3.model", "Qwen3", lambda m: bool(m.config.use_tied_embedding), "module"),
    ModelAdapter("qwen2", "tunix.models.qwen2.model", "Qwen2", lambda m: bool(m.config.use_tied_embedding), "module"),
    ModelAdapter("llama3", "tunix.models.llama3.model", "Llama3", lambda m: bool(m.config.weight_tying), "promote"),
    ModelAdapter("gemma3", "tunix.models.gemma3.model", "Gemma3", lambda m: True, "promote"),
)


def adapter_for(model) -> ModelAdapter:
    """The adapter of `model`'s class (a subclass, e.g. a Qwix-LoRA model, counts), or a clear error."""
    softcap = getattr(getattr(model, "config", None), "final_logit_softcap", None)
    if softcap is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__} applies final logit soft-capping (logits = tanh(z / {softcap}) * {softcap} "
            "after the lm_head); linear_logp computes the log-softmax of the linear logits z and cannot apply "
            "a soft-cap, so it would not give this model's logprobs"
        )
    for adapter in ADAPTERS:
        try:
            cls = adapter.model_class()
        except (ImportError, AttributeError):
            continue
        if isinstance(model, cls):
            return adapter
    known = ", ".join(f"{a.module}.{a.class_name}" for a in ADAPTERS)
    raise UnsupportedModelError(
        f"detlogp_jax.integrations.tunix does not know the model class {type(model).__module__}."
        f"{type(model).__qualname__}; known classes: {known} (add a row to ADAPTERS for another class)"
    )


@dataclasses.dataclass(frozen=True)
class _Head:
    weight: Any  # the Param's array, as stored (read in place)
    layout: str  # "vd" (tied embedding table) or "dv" (untied [D, V] kernel)
    module: Any  # the module that owns it (lm_head or embedder)
    variable: Any  # the nnx.Param
    adapter: ModelAdapter

    def compute_dtype(self, hidden_dtype):
        if self.adapter.head_dtype == "module":
            return jnp.dtype(self.module.dtype)
        return jnp.promote_types(hidden_dtype, self.weight.dtype)


def _head(model) -> _Head:
    adapter = adapter_for(model)
    tied = adapter.tied(model)
    module = model.embedder if tied else getattr(model, "lm_head", None)
    if module is None:
        raise UnsupportedModelError(f"{type(model).__name__} is untied but has no lm_head module")
    var = module.input_embedding if tied else module.w
    lora = jax.tree.leaves(nnx.state(module, nnx.LoRAParam))
    if lora:
        raise NotImplementedError(
            f"the {'tied embedder' if tied else 'lm_head'} of this {type(model).__name__} carries LoRA parameters; "
            "linear_logp reads the base weight only (apply LoRA to the body, not to the head)"
        )
    weight = var[...]
    if not hasattr(weight, "dtype") or not jnp.issubdtype(weight.dtype, jnp.floating):
        raise UnsupportedModelError(f"the head weight must be a float array, got {type(weight).__name__}")
    return _Head(weight, "vd" if tied else "dv", module, var, adapter)


def head_weight(model) -> tuple[jax.Array, str]:
    """(the lm_head weight as stored, its weight_layout): the tied embedding table [V, D] ("vd")
    or the untied Einsum kernel [D, V] ("dv"). The array is the Param's own (no copy)."""
    h = _head(model)
    return h.weight, h.layout


# --- the hidden states -------------------------------------------------------------------


class _HeadProbe:
    """Stands in for the head during one call: returns its input (the final hidden states)."""

    def __init__(self):
        self.dtype = None

    def __call__(self, x):
        self.dtype = jnp.dtype(x.dtype)
        return x


@contextlib.contextmanager
def _headless(model, head: _Head):
    probe = _HeadProbe()
    tied = head.layout == "vd"
    if tied:
        owner, name = model.embedder, "decode"
        had = "decode" in vars(owner)
        saved = vars(owner).get("decode")
    else:
        owner, name, had, saved = model, "lm_head", True, model.lm_head
    setattr(owner, name, probe)
    try:
        yield probe
    finally:
        if had:
            setattr(owner, name, saved)
        else:
            delattr(owner, name)


def _fresh(model):
    """A merged copy sharing the arrays (the head swap then never touches the caller's object)."""
    return nnx.merge(*nnx.split(model))


def _hidden_states(model, head: _Head, input_tokens, kwargs):
    with _headless(model, head) as probe:
        out, cache = model(input_tokens, **kwargs)
    if probe.dtype is None:
        raise UnsupportedModelError(f"{type(model).__name__}.__call__ did not call its lm_head")
    return out.astype(probe.dtype), cache  # exact: an identity, or Qwen's float32 cast of it


@functools.partial(jax.jit, static_argnames=("static", "body"))
def _jit_hidden_states_impl(graphdef, state, input_tokens, kwargs, *, static, body):
    model = nnx.merge(graphdef, state)
    return _hidden_states(model, _head(model), input_tokens, {**kwargs, **dict(static)})


def _jit_hidden_states(model, input_tokens, kwargs, body):
    """`_hidden_states` under jit (inlined when the caller is traced already): Python scalars
    among the model's keywords (flags) are static; `body` (the patched body and its backend)
    keys the trace, since the body's classes read it at trace time."""
    static = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))))
    arrays = {k: v for k, v in kwargs.items() if not isinstance(v, (bool, int, float, str))}
    return _jit_hidden_states_impl(*nnx.split(model), input_tokens, arrays, static=static, body=body)


def _forward_hidden(model, head: _Head, input_tokens, kwargs):
    """`_hidden_states`, or, while `patch(body=...)` is active, the model checked against the
    body's coverage and the forward compiled (as the sampler's steps are: eager RoPE rounds
    otherwise than its compiled form)."""
    body = _active_body()
    if body is None:
        return _hidden_states(model, head, input_tokens, kwargs)
    _check_body(model)
    return _jit_hidden_states(model, input_tokens, kwargs, body)


def hidden_states(model, input_tokens, **model_kwargs):
    """(final hidden states [B, L, D], new cache) of a Tunix model: its own ``__call__``
    (``positions=``, ``cache=``, ``attention_mask=``, ...) with the lm_head replaced by an
    identity, so no logits are computed. The hidden states are exactly what the head would have
    received (the output of the final norm, in its dtype). While `patch(body=...)` is active the
    model is checked against the body's coverage and the forward runs compiled (as
    `per_token_logps`)."""
    model = _fresh(model)
    return _forward_hidden(model, _head(model), input_tokens, model_kwargs)


# --- the op ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpOptions:
    """How the op runs (hashable: part of the jit keys of the patched functions).

    backend / padded_vocab_size / checked: passed to `linear_logp` (padded_vocab_size defaults
    to the weight's vocabulary rows; rollout and trainer must use the same value).
    mesh / tp_axis / row_axes: tensor parallelism. tp_axis="auto" routes through
    `sharding.linear_logp_tp` when the head Param's sharding metadata names a mesh axis of
    size > 1 for the vocabulary dimension (mesh: the argument, else the ambient ``with mesh:``
    or `jax.sharding.set_mesh` mesh); a name forces that axis; None never shards. row_axes:
    linear_logp_tp's sharding of the token rows (PartitionSpec entries for [B, L]).
    residuals: what the op's forward keeps for its backward (`linear_logp(residuals=...)`):
    "recompute" (default: O(N*D + V*D) memory, the backward recomputes the logits chunk by
    chunk: four GEMM passes per training step) or "logits" (the forward also keeps its FP32
    logits [N, V], so the backward is one elementwise pass and two GEMMs: three passes, as
    Tunix's own path with its bf16 logits). The logp bytes do not depend on it.
    """

    backend: str = "auto"
    padded_vocab_size: int | None = None
    checked: bool | None = None
    mesh: Any = None
    tp_axis: str | None = "auto"
    row_axes: tuple = ()
    residuals: str = "recompute"

    def __post_init__(self):
        inputs.check_residuals(self.residuals)


def _options(opts: OpOptions | None, kw: dict) -> OpOptions:
    opts = opts or OpOptions()
    if kw:
        unknown = set(kw) - {f.name for f in dataclasses.fields(OpOptions)}
        if unknown:
            raise TypeError(f"unknown op option(s) {sorted(unknown)}")
        kw = {k: (tuple(v) if k == "row_axes" and isinstance(v, list) else v) for k, v in kw.items()}
        opts = dataclasses.replace(opts, **kw)
    return opts


def _ambient_mesh():
    """The mesh a Tunix program runs under: the legacy ``with mesh:`` context (what Tunix's
    RLCluster enters), else `jax.sharding.set_mesh`'s (the abstract mesh inside a jit trace)."""
    try:
        from jax.interpreters import pxla

        mesh = pxla.thread_resources.env.physical_mesh
        if mesh is not None and not mesh.empty:
            return mesh
    except Exception:
        pass
    for get in (jax.sharding.get_mesh, jax.sharding.get_abstract_mesh):
        try:
            mesh = get()
        except Exception:  # get_mesh refuses inside jit
            continue
        if mesh is not None and not mesh.empty:
            return mesh
    return None


def _metadata_axis(head: _Head):
    meta = head.variable.get_metadata() if hasattr(head.variable, "get_metadata") else {}
    spec = None
    for key in ("out_sharding", "sharding", "sharding_names"):
        if meta.get(key) is not None:
            spec = meta[key]
            break
    if spec is None:
        return None
    v_axis = 0 if head.layout == "vd" else 1
    if len(spec) <= v_axis:
        return None
    name = spec[v_axis]
    if isinstance(name, (tuple, list)):
        name = name[0] if len(name) == 1 else None
    return name


def _tp_plan(head: _Head, opts: OpOptions):
    if opts.tp_axis is None:
        return None
    mesh = opts.mesh if opts.mesh is not None else _ambient_mesh()
    if opts.tp_axis == "auto":
        axis = _metadata_axis(head)
        if mesh is None or axis is None or axis not in mesh.shape or mesh.shape[axis] == 1:
            return None
        return mesh, axis
    if mesh is None:
        raise ValueError(f"tp_axis={opts.tp_axis!r} needs a mesh (pass mesh= or enter one)")
    if opts.tp_axis not in mesh.shape:
        raise ValueError(f"tp_axis {opts.tp_axis!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})")
    return mesh, opts.tp_axis


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _op(head: _Head, hidden, targets, opts: OpOptions, *, temperature, return_logits=False, return_entropy=False):
    """One call of the operator: `linear_logp` (or `linear_logp_tp`) on the head read in place."""
    dtype = head.compute_dtype(hidden.dtype)
    weight = head.weight if head.weight.dtype == dtype else head.weight.astype(dtype)  # Tunix's head casts too
    hidden = hidden if hidden.dtype == dtype else hidden.astype(dtype)
    v = weight.shape[0 if head.layout == "vd" else 1]
    kw = dict(
        temperature=temperature,
        vocab_size=v,
        padded_vocab_size=opts.padded_vocab_size,
        return_logits=return_logits,
        backend=opts.backend,
        checked=opts.checked,
        weight_layout=head.layout,
        residuals=opts.residuals,
    )
    plan = _tp_plan(head, opts)
    if plan is not None:
        fn = plugins.tensor_parallel().linear_logp_tp
        kw.update(mesh=plan[0], tp_axis=plan[1], row_axes=opts.row_axes)
    else:
        fn = api.linear_logp
    if return_entropy:
        if not _accepts(fn, "return_entropy"):
            raise NotImplementedError(
                f"{fn.__module__}.{fn.__name__} does not accept return_entropy yet; the per-token entropy "
                "passes through once the op computes it"
            )
        kw["return_entropy"] = True
    out = fn(hidden, weight, targets, **kw)
    logits = out.logits
    if logits is not None and logits.shape[-1] != v:
        logits = logits[..., :v]  # linear_logp_tp returns the padded columns
    entropy = getattr(out, "entropy", None) if return_entropy else None
    return out.logp, logits, entropy


def head_logits(model, hidden, *, opts: OpOptions | None = None, **op_kw) -> jax.Array:
    """FP32 unscaled logits [..., V] of `hidden` [..., D] from the op's serving entry
    (`linear_logp(..., return_logits=True)`): what the patched sampler draws from."""
    head = _head(model)
    targets = jnp.full(hidden.shape[:-1], C.IGNORE_INDEX, jnp.int32)
    return _op(head, hidden, targets, _options(opts, op_kw), temperature=1.0, return_logits=True)[1]


def token_logps(model, hidden, tokens, *, temperature=1.0, opts: OpOptions | None = None, **op_kw) -> jax.Array:
    """The op's logp [...] of `tokens` under the head's logits of `hidden` [..., D] divided by
    `temperature` (a positive scalar, or one per row). The one operator both the patched
    sampler (the sampled tokens' processed logprob) and `per_token_logps` use."""
    return _op(_head(model), hidden, tokens, _options(opts, op_kw), temperature=temperature)[0]


# --- the trainer side: Tunix's compute_per_token_logps semantics ------------------------


def _tunix_temperature(temperature):
    """Tunix scales the logits only for T not in {0, 1} (T == 0 means greedy: unscaled)."""
    if isinstance(temperature, (int, float)) and temperature in (0.0, 1.0):
        return 1.0
    return temperature


def per_token_logps(
    model,
    prompt_tokens,
    completion_tokens,
    *,
    pad_id: int,
    eos_id: int,
    temperature=1.0,
    images=None,
    segment_ids=None,
    segment_positions=None,
    stop_gradient: bool = False,
    return_logits: bool = False,
    return_entropy: bool = False,
    opts: OpOptions | None = None,
    **op_kw,
):
    """Per-token logprobs of a Tunix model, with the semantics of
    `tunix.rl.common.compute_per_token_logps` (the model instead of (graphdef, state)).

    prompt_tokens [B, P] (left-padded), completion_tokens [B, C] (right-padded): the
    positions, causal/pad attention mask and segment ids come from Tunix's own
    `tunix.rl.common.process_ids`; the result is logp [B, C] of each completion token given
    everything before it, at every position (mask with the completion mask as Tunix does).
    Packed sequences (`segment_ids` and `segment_positions` given, prompt_tokens [B, 0]):
    logp [B, L] of the packed buffer with 0.0 at position 0, as Tunix returns. temperature:
    the logits are divided by it unless it is 0 or 1 (Tunix's rule). Differentiable w.r.t. the
    model's parameters (`stop_gradient=True` detaches, Tunix's default there).

    Returns logp, or a tuple (logp, logits [B, C, V] / T) with `return_logits` (these are
    materialized: only a caller that asks gets them), (logp, entropy [B, C]) with
    `return_entropy` (when the op supports it; NotImplementedError until then), or
    (logp, logits, entropy) with both. Op options (`backend`, `padded_vocab_size`, `mesh`,
    `tp_axis`, `row_axes`, `checked`, `residuals`) go as keywords or `opts=OpOptions(...)`.
    """
    from tunix.rl import common

    opts = _options(opts, op_kw)
    model = _fresh(model)
    head = _head(model)
    packed = segment_ids is not None
    if packed and _active_body() is not None:
        raise NotImplementedError(
            "patch(body='batch_invariant') does not cover packed sequences (segment_ids / segment_positions): "
            "body.attention attends one sequence per row, from its first real slot"
        )
    input_tokens, positions, attn_mask, input_seg_ids = common.process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions
    )
    kwargs = {"positions": positions, "cache": None, "attention_mask": attn_mask}
    try:  # the same rule as Tunix: segment ids only for a __call__ that takes them
        sig = inspect.signature(model.__call__)
        takes_seg = "segment_ids" in sig.parameters or any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
        )
    except Exception:
        takes_seg = False
    if takes_seg:
        if segment_ids is not None:
            kwargs["segment_ids"] = segment_ids
        elif input_seg_ids is not None:
            kwargs["segment_ids"] = input_seg_ids
    if images is not None:
        kwargs["images"] = images
    hidden, _ = _forward_hidden(model, head, input_tokens, kwargs)

    keep = input_tokens.shape[1] - 1 if packed else completion_tokens.shape[1]
    h = hidden[:, hidden.shape[1] - keep - 1 : hidden.shape[1] - 1]
    targets = input_tokens[:, input_tokens.shape[1] - keep :]
    t = _tunix_temperature(temperature)
    logp, logits, entropy = _op(
        head, h, targets, opts, temperature=t, return_logits=return_logits, return_entropy=return_entropy
    )
    if logits is not None and not (isinstance(t, (int, float)) and t == 1.0):
        logits = logits / (jnp.asarray(t, jnp.float32)[..., None] if hasattr(t, "shape") else t)
    if packed:
        logp = jnp.pad(logp, ((0, 0), (1, 0)), constant_values=0.0)
        if logits is not None:
            logits = jnp.pad(logits, ((0, 0), (1, 0), (0, 0)), constant_values=0.0)
        if entropy is not None:
            entropy = jnp.pad(entropy, ((0, 0), (1, 0)), constant_values=0.0)
    if stop_gradient:
        logp, logits, entropy = jax.tree.map(jax.lax.stop_gradient, (logp, logits, entropy))
    extras = tuple(x for x, want in ((logits, return_logits), (entropy, return_entropy)) if want)
    return (logp, *extras) if extras else logp


def compute_per_token_logps_fn(opts: OpOptions | None = None, *, entropy: str = "logits"):
    """A drop-in for `tunix.rl.common.compute_per_token_logps` (same signature, same jit static
    arguments) that computes through `per_token_logps`.

    entropy: what a caller asking `return_logits=True` gets (Tunix's GRPO/PPO losses always
    ask, for the token entropy): "logits" returns the op's FP32 logits / T [B, C, V]
    (materialized, as Tunix does: the one [B, C, V] array left in a patched training step);
    "op" returns a `TokenEntropy` carrying the op's per-token entropy instead, which the patched
    `algo_core.compute_entropy_from_logits` reads (needs `linear_logp(return_entropy=True)`);
    "none" returns a `TokenEntropy` of NaN (no [B, C, V] anywhere; GRPO's "entropy" metric then
    reads NaN, and a loss that uses the entropy, PPO with entropy_coef != 0, becomes NaN and so do
    its gradients: loud, never an optimizer step without the entropy term; a metric alone, which
    gets no cotangent, leaves the gradients as they are).
    """
    opts = opts or OpOptions()

    @functools.partial(jax.jit, static_argnames=("pad_id", "eos_id", "stop_gradient", "return_logits", "temperature"))
    def compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens,
        completion_tokens,
        pad_id,
        eos_id,
        images=None,
        stop_gradient=True,
        return_logits=False,
        segment_ids=None,
        segment_positions=None,
        temperature=1.0,
    ):
        model = nnx.merge(graphdef, state)
        if return_logits and entropy == "none":
            lp = per_token_logps(
                model,
                prompt_tokens,
                completion_tokens,
                pad_id=pad_id,
                eos_id=eos_id,
                temperature=temperature,
                images=images,
                segment_ids=segment_ids,
                segment_positions=segment_positions,
                stop_gradient=stop_gradient,
                opts=opts,
            )
            return lp, TokenEntropy(_entropy_not_computed(lp))
        want_entropy = return_logits and entropy == "op"
        out = per_token_logps(
            model,
            prompt_tokens,
            completion_tokens,
            pad_id=pad_id,
            eos_id=eos_id,
            temperature=temperature,
            images=images,
            segment_ids=segment_ids,
            segment_positions=segment_positions,
            stop_gradient=stop_gradient,
            return_logits=return_logits and not want_entropy,
            return_entropy=want_entropy,
            opts=opts,
        )
        if want_entropy:
            return out[0], TokenEntropy(out[1])
        return out

    compute_per_token_logps.__detlogp__ = True
    return compute_per_token_logps


@jax.custom_vjp
def _entropy_not_computed(logp):
    """NaN [B, C] in place of an entropy that was not computed (`patch(entropy="none")`), tied
    to the logprobs: its cotangent, where a loss uses it (nonzero), reaches them as NaN, so the
    gradients of such a loss are NaN like the loss itself; a zero cotangent (a metric) adds 0."""
    return jnp.full(logp.shape, jnp.nan, jnp.float32)


def _entropy_not_computed_fwd(logp):
    return _entropy_not_computed(logp), None


def _entropy_not_computed_bwd(_, ct):
    return (jnp.where(ct != 0, jnp.nan, 0.0).astype(jnp.float32),)


_entropy_not_computed.defvjp(_entropy_not_computed_fwd, _entropy_not_computed_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenEntropy:
    """Stands where Tunix expects the logits [B, C, V] when only their entropy is used
    (`patch(entropy="op")`: the op's per-token entropy [B, C]; `patch(entropy="none")`: NaN)."""

    entropy: jax.Array


# --- the sampler side --------------------------------------------------------------------


class RolloutRecord(NamedTuple):
    """What the patched sampler records on each call that returns logprobs: the lm_head
    fingerprint (`detlogp_jax.fingerprint`) of the weight it used, and how it scored."""

    fingerprint: str
    layout: str
    sampling_mode: str
    temperature: float
    backend: str


def head_fingerprint(model_or_sampler) -> str:
    """`weight_fingerprint` of the lm_head weight as stored (a Tunix model, or a Tunix Sampler:
    the weights it samples with now)."""
    model = model_or_sampler
    if hasattr(model_or_sampler, "_transformer_graphdef"):
        model = nnx.merge(model_or_sampler._transformer_graphdef, model_or_sampler._flattened_transformer_state)
    return fp_lib.weight_fingerprint(_head(model).weight)


def rollout_record(sampler) -> RolloutRecord | None:
    """The record of the patched sampler's last call with ``return_logprobs=True`` (None before)."""
    return vars(sampler).get("_detlogp_record")


def check_weight_version(model, expected) -> str:
    """Raises `FingerprintMismatchError` unless `model`'s lm_head has the fingerprint `expected`
    (a string or a `RolloutRecord`); returns the fingerprint."""
    want = expected.fingerprint if isinstance(expected, RolloutRecord) else expected
    got = head_fingerprint(model)
    fp_lib.check_fingerprints(want, got, what="lm_head (rollout vs trainer)")
    return got


def _record_logp(state, transformer, hidden_last, step, opts: OpOptions, logprobs_buffer):
    """Writes the op's logp of the token just sampled at `step` into the logprobs buffer."""
    if logprobs_buffer is None:
        return dataclasses.replace(state, logprobs_buffer=None)
    tok = state.token_buffer[:, step]
    t = state.temperature if state.sampling_mode == "top_p" else 1.0  # Tunix: greedy records log_softmax(z)
    lp = token_logps(transformer, hidden_last, tok, temperature=t, opts=opts)
    return dataclasses.replace(state, logprobs_buffer=logprobs_buffer.at[:, step].set(lp))


def _check_sampler_state(state):
    if state.sampling_mode == "beam_search":
        raise NotImplementedError(
            "the patched Tunix sampler scores greedy and top_p sampling; beam search keeps its own scores "
            "(unpatch() to use it)"
        )
    if state.forbidden_token_ids and state.logprobs_buffer is not None:
        raise NotImplementedError(
            "forbidden_tokens with return_logprobs: the op's logprob cannot exclude forbidden tokens from its "
            "normaliser (Tunix's does); sample without forbidden_tokens or without return_logprobs"
        )


def _op_prefill_fn(self, params, sampler_state, images=None, echo=True, *, opts: OpOptions):
    """Tunix 0.1.7 `Sampler._prefill_fn` (greedy / top_p), with the logits from the op's
    serving entry and the sampled token's logprob from the op."""
    from tunix.generate import utils

    _check_sampler_state(sampler_state)
    batch_size = sampler_state.token_buffer.shape[0]
    zeros = jnp.zeros((sampler_state.token_buffer.ndim,), dtype=jnp.int32)
    n_in = sampler_state.num_input_tokens
    tokens = jax.lax.dynamic_slice(sampler_state.token_buffer, zeros, (batch_size, n_in))
    step_positions = jax.lax.dynamic_slice(sampler_state.positions, zeros, (batch_size, n_in))
    input_mask = tokens != self.tokenizer.pad_id()
    if hasattr(self.transformer, "get_attention_mask"):
        attention_mask = self.transformer.get_attention_mask(tokens, inputs_mask=input_mask)
        padding = self.cache_config.cache_size - attention_mask.shape[-1]
        attention_mask = jnp.pad(attention_mask, (*((0, 0) for _ in range(attention_mask.ndim - 1)), (0, padding)))
    else:
        attention_mask = utils.make_causal_attn_mask(input_mask, self.cache_config.cache_size)

    transformer = nnx.merge(self._transformer_graphdef, params)
    head = _head(transformer)
    if _active_body() is not None:
        _check_body(transformer)
    kwargs = {} if images is None else {"images": images}
    decode_only_last_token = self._supports_decode_only_last_token and not echo
    if decode_only_last_token:
        kwargs["decode_only_last_token"] = True
    hidden, cache = _hidden_states(
        transformer,
        head,
        tokens,
        dict(positions=step_positions, cache=sampler_state.cache, attention_mask=attention_mask, **kwargs),
    )
    last = hidden[:, -1]
    logits_buffer = sampler_state.logits_buffer
    if logits_buffer is not None:  # return_logits: the op's logits of every prompt position
        start_idx = n_in if decode_only_last_token else 1
        all_logits = head_logits(transformer, hidden, opts=opts)
        logits_buffer = jax.lax.dynamic_update_slice(
            logits_buffer, all_logits.astype(logits_buffer.dtype), (0, start_idx, 0)
        )
    logits = head_logits(transformer, last, opts=opts)[:, None, :]
    state = dataclasses.replace(sampler_state, cache=cache, logits_buffer=logits_buffer, logprobs_buffer=None)
    new = self._sample(logits=logits, cache=cache, eos=self.eos_ids, sampler_state=state)
    return _record_logp(new, transformer, last, sampler_state.decoding_step + 1, opts, sampler_state.logprobs_buffer)


def _op_sample_step(self, params, sampler_state, *, opts: OpOptions):
    """Tunix 0.1.7 `Sampler._sample_step`, with the op's logits and logprob."""
    from tunix.generate import utils

    batch_size = sampler_state.token_buffer.shape[0]
    decoding_step = sampler_state.decoding_step
    last_token = sampler_state.token_buffer[:, decoding_step].reshape((batch_size, 1))
    step_positions = jnp.expand_dims(sampler_state.positions[:, decoding_step], -1)
    input_mask = sampler_state.token_buffer == self.tokenizer.pad_id()
    attention_mask = utils.compute_attention_masks(decoding_step, self.cache_config.cache_size, input_mask)
    transformer = nnx.merge(self._transformer_graphdef, params)
    head = _head(transformer)
    if _active_body() is not None:
        _check_body(transformer)
    hidden, cache = _hidden_states(
        transformer,
        head,
        last_token,
        dict(positions=step_positions, cache=sampler_state.cache, attention_mask=attention_mask),
    )
    last = hidden[:, -1]
    logits = head_logits(transformer, last, opts=opts)[:, None, :]
    state = dataclasses.replace(sampler_state, logprobs_buffer=None)
    new = self._sample(logits=logits, cache=cache, eos=self.eos_ids, sampler_state=state)
    new = _record_logp(new, transformer, last, decoding_step + 1, opts, sampler_state.logprobs_buffer)
    if new.logits_buffer is not None:
        new = dataclasses.replace(new, logits_buffer=new.logits_buffer.at[:, decoding_step + 1].set(logits[:, 0]))
    return new


def _op_decode_fn(self, params, sampling_state, *, opts: OpOptions):
    """Tunix 0.1.7 `Sampler._decode_fn` over `_op_sample_step`."""

    def cond_fn(s):
        return (s.decoding_step < s.total_sampling_steps) & jnp.any(jnp.logical_not(s.done))

    return jax.lax.while_loop(cond_fn, lambda s: _op_sample_step(self, params, s, opts=opts), sampling_state)


def _build_prefill(sampler, opts: OpOptions):
    jitted = jax.jit(
        lambda params, state, images=None, echo=True: _op_prefill_fn(sampler, params, state, images, echo, opts=opts),
        donate_argnums=(1,),
        static_argnames=("echo",),
    )

    def prefill(params, state, images=None, echo=True):
        if state.logprobs_buffer is not None:  # record the weight version the logprobs come from
            model = nnx.merge(sampler._transformer_graphdef, params)
            head = _head(model)
            sampler.__dict__["_detlogp_record"] = RolloutRecord(
                fingerprint=fp_lib.weight_fingerprint(head.weight),
                layout=head.layout,
                sampling_mode=state.sampling_mode,
                temperature=float(state.temperature) if state.sampling_mode == "top_p" else 1.0,
                backend=opts.backend,
            )
        return jitted(params, state, images, echo=echo)

    return prefill


def _build_decode(sampler, opts: OpOptions):
    return jax.jit(lambda params, state: _op_decode_fn(sampler, params, state, opts=opts), donate_argnums=(1,))


class _CompiledRoute:
    """A data descriptor on `Sampler` for `_compiled_prefill_fn` / `_compiled_decode_fn` while
    patched: every Sampler, made before or after `patch()`, gets this module's jitted step
    (built once per sampler, options and body). Tunix's own compiled functions, which
    `__init__` assigns, stay in the instance and serve again after `unpatch()`."""

    def __init__(self, name: str, build, opts: OpOptions, body=None):
        self.name, self.build, self.opts, self.body = name, build, opts, body

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        cache = obj.__dict__.setdefault("_detlogp_compiled", {})
        key = (self.name, self.opts, self.body)  # the body: traced anew for another body
        if key not in cache:
            cache[key] = self.build(obj, self.opts)
        return cache[key]

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value


# --- patch() -----------------------------------------------------------------------------

# (module, attribute path, expected parameter names) of everything patch() replaces or calls.
_EXPECTED_SIGNATURES = (
    (
        "tunix.rl.common",
        "compute_per_token_logps",
        (
            "graphdef",
            "state",
            "prompt_tokens",
            "completion_tokens",
            "pad_id",
            "eos_id",
            "images",
            "stop_gradient",
            "return_logits",
            "segment_ids",
            "segment_positions",
            "temperature",
        ),
    ),
    (
        "tunix.rl.common",
        "process_ids",
        ("prompt_tokens", "completion_tokens", "pad_id", "eos_id", "segment_ids", "segment_positions"),
    ),
    ("tunix.rl.algo_core", "compute_entropy_from_logits", ("logits",)),
    ("tunix.generate.sampler", "Sampler._prefill_fn", ("self", "params", "sampler_state", "images", "echo")),
    ("tunix.generate.sampler", "Sampler._sample_step", ("self", "params", "sampler_state")),
    ("tunix.generate.sampler", "Sampler._decode_fn", ("self", "params", "sampling_state")),
    ("tunix.generate.sampler", "Sampler._sample", ("self", "logits", "eos", "cache", "sampler_state")),
    ("tunix.generate.utils", "make_causal_attn_mask", ("input_mask", "cache_size")),
    ("tunix.generate.utils", "compute_attention_masks", ("time_step", "seq_len", "input_mask")),
)
_SAMPLING_STATE_FIELDS = (
    "decoding_step",
    "token_buffer",
    "positions",
    "cache",
    "done",
    "total_sampling_steps",
    "logits_buffer",
    "logprobs_buffer",
    "forbidden_token_ids",
    "sampling_mode",
    "num_input_tokens",
    "temperature",
)


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def tunix_version() -> str | None:
    try:
        return importlib.metadata.version("google-tunix")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_tunix(*, allow_unverified_version: bool = False, body: str | None = None) -> str:
    """Checks that the installed Tunix is one `patch()` knows: its version (unless
    `allow_unverified_version`), and the signatures of the functions it replaces or calls
    (with `body`, also the model classes' methods the batch-invariant body replaces).
    Returns the version; raises `TunixVersionError` naming what differs."""
    version = tunix_version()
    if version is None:
        raise TunixVersionError("google-tunix is not installed (pip install 'detlogp-jax[tunix]')")
    if version not in SUPPORTED_TUNIX_VERSIONS and not allow_unverified_version:
        raise TunixVersionError(
            f"google-tunix {version} is not a version this integration was checked against "
            f"({', '.join(SUPPORTED_TUNIX_VERSIONS)}); patch(allow_unverified_version=True) tries it anyway "
            "(the signatures are still checked)"
        )
    problems = []
    expected_signatures = _EXPECTED_SIGNATURES + (tunix_body.EXPECTED_SIGNATURES if body else ())
    for module, path, expected in expected_signatures:
        try:
            fn = _resolve(module, path)
        except (ImportError, AttributeError) as e:
            problems.append(f"{module}.{path} is missing ({e})")
            continue
        if expected is None:
            continue
        fn = inspect.unwrap(getattr(fn, "__detlogp_original__", fn))
        try:
            got = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError) as e:
            problems.append(f"{module}.{path}: no signature ({e})")
            continue
        if got != expected:
            problems.append(f"{module}.{path}{got} (expected {expected})")
    try:
        from tunix.generate import sampler as sampler_lib

        fields = {f.name for f in dataclasses.fields(sampler_lib._SamplingState)}
        missing = [f for f in _SAMPLING_STATE_FIELDS if f not in fields]
        if missing:
            problems.append(f"tunix.generate.sampler._SamplingState lacks {missing}")
        init_src = inspect.getsource(sampler_lib.Sampler.__init__)
        for name in ("self._compiled_prefill_fn", "self._compiled_decode_fn", "self._supports_decode_only_last_token"):
            if name not in init_src:
                problems.append(f"Sampler.__init__ no longer sets {name}")
    except (ImportError, OSError, TypeError) as e:
        problems.append(f"tunix.generate.sampler cannot be inspected ({e})")
    if problems:
        raise TunixVersionError(
            f"google-tunix {version}: the functions detlogp_jax.integrations.tunix replaces are not the ones it "
            "mirrors: " + "; ".join(problems)
        )
    return version


_LOCK = threading.RLock()
_ACTIVE: dict = {}  # while patched: {"config": ..., "saved": [(owner, name, had, value), ...]}


@dataclasses.dataclass(frozen=True)
class _PatchConfig:
    opts: OpOptions
    entropy: str
    sampler: bool
    body: str | None = None
    body_backend: str = "auto"


def _active_body() -> tuple[str, str] | None:
    """(body, body_backend) of the active patch when it replaces the model body, else None."""
    config = _ACTIVE.get("config")
    if config is None or config.body is None:
        return None
    return config.body, config.body_backend


def _check_body(model) -> None:
    """Refuses a model the patched batch-invariant body does not cover (`tunix_body.check_model`)."""
    tunix_body.check_model(model, adapter_for(model).name)


class _Patch(contextlib.AbstractContextManager):
    """The handle `patch()` returns; as a context manager it unpatches on exit if it patched."""

    def __init__(self, owner: bool, config: _PatchConfig):
        self.owner = owner
        self.config = config

    def __exit__(self, *exc):
        if self.owner:
            unpatch()
        return False


def _entropy_from_logits(original):
    def compute_entropy_from_logits(logits):
        if isinstance(logits, TokenEntropy):
            return logits.entropy
        return original(logits)

    compute_entropy_from_logits.__detlogp_original__ = original
    return compute_entropy_from_logits


def patch(
    *,
    backend: str = "auto",
    padded_vocab_size: int | None = None,
    mesh=None,
    tp_axis: str | None = "auto",
    row_axes=(),
    checked: bool | None = None,
    entropy: str = "logits",
    sampler: bool = True,
    allow_unverified_version: bool = False,
    residuals: str = "recompute",
    body: str | None = None,
    body_backend: str = "auto",
):
    """Routes Tunix's logprob computations through `linear_logp`; returns a handle that is
    also a context manager (``with patch(): ...`` unpatches on exit).

    Replaces, in place (every caller looks them up at call time):

    * `tunix.rl.common.compute_per_token_logps` (the GRPO/DAPO/Dr.GRPO/PPO policy losses in
      `tunix.rl.algo_core`, the actor's and the anchor's old logps in `RLCluster`, the reference
      logps in the inference worker, the vanilla rollout's `get_per_token_logps`) by
      `compute_per_token_logps_fn(...)`: same signature and results, computed by
      `per_token_logps`;
    * with entropy="op" or "none", `tunix.rl.algo_core.compute_entropy_from_logits` by a
      version that also reads `TokenEntropy` (see `compute_per_token_logps_fn` for the modes:
      the default "logits" hands Tunix's losses the op's [B, C, V] logits, as Tunix does);
    * with `sampler` (default), the vanilla `tunix.generate.sampler.Sampler`'s compiled prefill
      and decode steps (for every Sampler, existing or new): the model body runs headless, the
      sampler draws from `head_logits` and records `token_logps` of the sampled token (at the
      sampling temperature for top_p, unscaled for greedy, as Tunix records them) and a
      `RolloutRecord` with the head's fingerprint.

    * with body="batch_invariant", the transformer body of Tunix's Qwen3 (dense), Qwen2 and
      Llama3 classes (``Attention.block``, ``MLP.block``, ``RMSNorm.__call__`` of each model
      module, `tunix_body.replacements`): projections through `body.einsum` (weights read in
      place), attention through `body.attention` over the sampler's own KV cache (its layout,
      its slots; each sequence's ``kv_start`` and positions read from Tunix's attention mask,
      padding queries at position -1, which give +0), norms through `body.rms_norm`; RoPE,
      SiLU gates and residual adds stay Tunix's own. So the sampler's prefill and decode steps
      and the learners' forward (`per_token_logps`) compute every real token's hidden state,
      hence its logprob, with the same bytes in any batch: the rollout-recorded logprob of a
      token equals the trainer's `per_token_logps` of the same (prompt, completion) in a batch
      of another size, order and padding, bit for bit. The backward of each body op is the
      VJP of its plain jnp formula (differentiable; gradients are not bitwise invariant).
      Other model classes (Gemma3: sliding-window layers), a Qwen3 with experts, LoRA
      parameters and packed sequences are refused (`UnsupportedModelError` /
      NotImplementedError) on the paths above. `body_backend`: the body ops' backend ("auto":
      the Hopper kernels on an H100/H200, else "reference"; "reference", "pallas_sm90", or
      "xla", the non-invariant baseline lane), chosen under `detlogp_jax.strict_mode()`,
      which refuses a non-invariant backend or a fallback (`StrictModeError`) when the body
      is traced. See `detlogp_jax.integrations.tunix_body` for positions, padding and the cache.

    The op options (backend, padded_vocab_size, checked, mesh, tp_axis, row_axes, residuals)
    are `OpOptions`'; residuals="logits" gives the training step's backward three GEMM passes
    instead of four, for O(N * V) FP32 logits kept from the forward.

    Patch before the first call of whatever jits a Tunix step (a learner's train step, a
    sampler): a function JAX has already traced keeps the path it was traced with (Tunix's before
    patch(), the op's after, until it retraces), as with any Python-level switch under jit.

    Idempotent: patching again with the same options does nothing (its handle does not
    unpatch); with other options (another body included) it raises (unpatch() first).
    `unpatch()` restores every replaced object, the model classes' methods included. Refuses
    (`TunixVersionError`) a Tunix whose version or replaced functions it does not know, and
    (ValueError) an unknown `body` or `body_backend`.
    """
    if entropy not in ("logits", "op", "none"):
        raise ValueError(f"entropy must be 'logits', 'op' or 'none', got {entropy!r}")
    if body not in BODIES:
        raise ValueError(
            f"body must be one of {BODIES} (None: Tunix's own model body; 'batch_invariant': the body on "
            f"detlogp_jax.body's ops), got {body!r}"
        )
    if not isinstance(body_backend, str) or (body_backend != "auto" and body_backend not in body_backends.names()):
        raise ValueError(
            f"body_backend must be 'auto' or a registered body backend {list(body_backends.names())}, "
            f"got {body_backend!r}"
        )
    opts = OpOptions(
        backend=backend,
        padded_vocab_size=padded_vocab_size,
        checked=checked,
        mesh=mesh,
        tp_axis=tp_axis,
        row_axes=tuple(row_axes),
        residuals=residuals,
    )
    config = _PatchConfig(opts, entropy, bool(sampler), body, body_backend if body else "auto")
    with _LOCK:
        if _ACTIVE:
            if _ACTIVE["config"] == config:
                return _Patch(False, config)
            raise RuntimeError(
                f"detlogp_jax.integrations.tunix is already patched with {_ACTIVE['config']}; unpatch() first"
            )
        check_tunix(allow_unverified_version=allow_unverified_version, body=body)
        if entropy == "op" and not _accepts(api.linear_logp, "return_entropy"):
            raise NotImplementedError(
                "patch(entropy='op') needs linear_logp(return_entropy=True), which this detlogp_jax does not have "
                "yet; use entropy='logits'"
            )
        from tunix.generate import sampler as sampler_lib
        from tunix.rl import algo_core, common

        body_patches = tunix_body.replacements(body_backend) if body is not None else []  # before any change
        saved = []

        def replace(owner, name, value):
            had = name in vars(owner)
            saved.append((owner, name, had, vars(owner).get(name)))
            setattr(owner, name, value)

        original = common.compute_per_token_logps
        new = compute_per_token_logps_fn(opts, entropy=entropy)
        new.__detlogp_original__ = original
        replace(common, "compute_per_token_logps", new)
        if entropy in ("op", "none"):
            replace(
                algo_core, "compute_entropy_from_logits", _entropy_from_logits(algo_core.compute_entropy_from_logits)
            )
        if sampler:
            cls = sampler_lib.Sampler
            key = (config.body, config.body_backend)
            replace(cls, "_compiled_prefill_fn", _CompiledRoute("_compiled_prefill_fn", _build_prefill, opts, key))
            replace(cls, "_compiled_decode_fn", _CompiledRoute("_compiled_decode_fn", _build_decode, opts, key))
        for owner, name, value in body_patches:
            replace(owner, name, value)
        _ACTIVE.update(config=config, saved=saved)
        return _Patch(True, config)


def unpatch() -> bool:
    """Restores every Tunix function and model-class method `patch()` replaced (the original
    objects). Returns whether anything was patched."""
    with _LOCK:
        if not _ACTIVE:
            return False
        for owner, name, had, value in reversed(_ACTIVE["saved"]):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        _ACTIVE.clear()
        return True


def is_patched() -> bool:
    return bool(_ACTIVE)
