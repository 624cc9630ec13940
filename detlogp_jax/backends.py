"""Backend registry, `auto` resolution and strict mode.

A backend is contract-bearing when its logp/lse are the oracle's function of
its own FP32 logits (`reference`, `pallas_sm90`). `xla` (materialized logits +
log_softmax) is the non-contract baseline lane. In strict mode only
contract-bearing backends may serve, and any fallback away from the requested
(or, for `auto`, the platform's preferred) backend raises `StrictModeError`.

The op core never imports a backend package. A backend outside the core is a
plugin: a `module:attribute` spec naming a function that returns its
`Backend` entry. Specs come from the `detlogp_jax.backends` entry-point group
of installed distributions (this project declares `pallas_sm90` in its
pyproject) and, for a source checkout that is not installed, from
`BUILTIN_PLUGINS`. A plugin is imported on first use; if the import fails the
backend is registered as unavailable with the import error as its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Callable

import jax

from detlogp_jax import contract as C
from detlogp_jax.layout import DV, VD, WeightLayout, as_layout
from detlogp_jax.registry import PluginRegistry


class StrictModeError(RuntimeError):
    """Strict mode refused a non-contract backend or a fallback."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here or cannot serve this call."""


@dataclasses.dataclass(frozen=True)
class DzKernel:
    """A backend's fused recompute + dz kernel for the chunked backward (`detlogp_jax.grad`).

    fn(hidden_p, w_c, bias_c, targets_c, inv_t, lse, c1, c2, lo, hi) -> dz [n_pad, chunk]
    in the model dtype, where dz = c1 * p + c2 * onehot on columns [lo, hi) of the
    chunk and 0 elsewhere (p = exp(z * inv_t - lse), z recomputed from hidden_p and
    w_c); hidden_p and the row vectors are padded to a multiple of `row_multiple`
    rows. `supports(hidden, weight, chunk)` says whether it takes these operands.

    entropy: the kernel declares the entropy term. Then grad.backward also uses it
    when the entropy has a cotangent, calling fn(..., lo, hi, c3=c3, h=h) with two more
    row vectors, and fn must return dz = c1 * p + c2 * onehot + c3 * p * (lp + h), where
    lp = z * inv_t - lse (so p = exp(lp)) and h is the row's forward entropy. A kernel
    without it (the default) is never given an entropy cotangent: grad.backward then
    forms dz with XLA. (The temperature gradient always uses the XLA-formed path: it
    needs per-row sums over the vocabulary that dz kernels do not return.) The residual
    mode (`linear_logp(..., residuals="logits")`) never calls it either: its backward
    forms dz with XLA from the forward's saved logits, and this kernel, which recomputes
    z from hidden and w_c, has no logits input.

    layouts: the weight layouts it reads. grad.backward passes the call's `WeightLayout` to
    supports(hidden, weight, chunk, weight_layout) and to fn(..., weight_layout=...); with
    DV ([D, V] weight) w_c is a [D, chunk] slice of the kernel, with VD a [chunk, D] one.
    """

    fn: Callable
    supports: Callable[[Any, Any, int], bool]
    row_multiple: int
    layouts: frozenset = frozenset({VD})  # the WeightLayouts of w_c it takes (VD: [chunk, D], DV: [D, chunk])
    entropy: bool = False  # takes the entropy term (c3, h); see above
    in_place: "InPlaceWalk | None" = None  # kernels that walk the chunks without copies; see InPlaceWalk

    def __post_init__(self):
        object.__setattr__(self, "layouts", _layouts(self.layouts))


@dataclasses.dataclass(frozen=True)
class InPlaceWalk:
    """A backend's chunk walk without weight-chunk or dW-chunk copies (`DzKernel.in_place`).

    grad.backward uses it instead of slicing the weight and running XLA's gradient GEMMs
    when `supports(n_pad, d, v_rows, chunk, weight_layout)` holds (n_pad: the padded rows):
    per chunk [start, start + chunk), with bounds = int32 [3] (start, lo, hi) (absolute
    columns; start = i * chunk, and for the last r = v_rows mod chunk columns one chunk of a
    length L in [r, chunk] at v_rows - L, the shortest L for which `supports` holds: it sees
    v_rows and the chunk length, so it decides which offsets the kernels must take),
      dz = dz(hidden_p, weight, bias, targets, inv_t, lse, c1, c2, bounds, chunk=, c3=, h=,
              weight_layout=)    -- `DzKernel.fn`'s dz, with the whole weight / bias and
                                    absolute targets
      dh = dh(dh, dz, weight, start, weight_layout=)   -- dh + dz @ W_c, FP32, in dh's buffer
      dW = dw(dW, dz, hidden_p, start, col0=, cols=, weight_layout=)
                                 -- dW's rows (or [D, V] columns) [start, start + cols) set
                                    to dz[:, col0 : col0 + cols].T @ hidden_p, in dW's buffer
    `dw_cols_supported(cols)`: whether `dw` takes a last chunk's `cols` new columns at col0 > 0
    (else grad.backward writes that chunk's whole dW block before the full chunks, which then
    overwrite its first rows)."""

    dz: Callable
    dh: Callable
    dw: Callable
    supports: Callable[..., bool]
    dw_cols_supported: Callable[[int], bool]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registered backend: all that the op core needs from it.

    Contract-bearing backends provide `partials` and `fold` (see
    `detlogp_jax.reference` for the signatures); others provide `forward`
    (hidden, weight, bias, targets, inv_t, vocab_size, return_logits) ->
    (logp, lse, logits). `dz`: an optional fused backward kernel (else XLA
    forms dz). `unavailable_reason()`: why `available()` is False here.

    `entropy`: the backend produces the per-row entropy (`return_entropy=True`).
    A contract-bearing one then accepts `partials(..., return_entropy=True)`, which
    returns a sixth array (the statistic A [N, n_local], `linear-logp-entropy-v1`),
    and `fold(..., a=A)`, which returns (logp, lse, entropy); a non-contract one
    accepts `forward(..., return_entropy=True)` -> (logp, lse, logits, entropy).
    A backend without it (the default, e.g. an older plugin) refuses a call with
    `return_entropy=True` (`resolve`).

    `fused_forward` (contract-bearing backends, optional): takes `partials`' arguments
    (and `fold`'s vocab_size) and returns (logp, lse, logits | None, entropy | None) with
    exactly the bytes of `fold(*partials(...)[:3], targets, inv_t, vocab_size, a=...)`;
    the op core uses it for an unsharded head (tensor parallelism needs the partials
    themselves), so a backend can skip re-laying out the partials between its kernels.
    """

    name: str
    contract_bearing: bool
    available: Callable[[], bool]
    supports: Callable[[Any, Any], tuple[bool, str]]
    partials: Callable | None = None
    fold: Callable | None = None
    forward: Callable | None = None
    # Contract-bearing, optional: fold(partials(...)) of an unsharded head in one call (see the class doc).
    fused_forward: Callable | None = None
    dz: DzKernel | None = None
    # The WeightLayouts it reads in place (VD [V, D], DV [D, V]; a plugin may declare them by
    # name). `supports(hidden, weight)` sees a [V, D] weight; for another declared layout it is
    # called as `supports(hidden, weight, weight_layout=<WeightLayout>)` with the weight in that
    # layout. Every backend call of a non-default layout gets `weight_layout=<WeightLayout>`.
    layouts: frozenset = frozenset({VD})
    description: str = ""
    knobs: frozenset = frozenset()  # the bit-neutral tuning knobs it applies
    unavailable_reason: Callable[[], str] = lambda: "not available on this machine"
    entropy: bool = False  # produces the entropy statistic (return_entropy=True); see above

    def __post_init__(self):
        object.__setattr__(self, "layouts", _layouts(self.layouts))

    def reads(self, layout) -> bool:
        """Whether it reads a weight of this layout (a `WeightLayout` or its name) in place."""
        return as_layout(layout) in self.layouts

    def tuning_kwargs(self, tuning) -> dict:
        """The subset of bit-neutral `tuning` items this backend applies."""
        return {k: v for k, v in dict(tuning or ()).items() if k in self.knobs}


def _layouts(layouts) -> frozenset:
    """A declared set of layouts (WeightLayouts or their names) as WeightLayouts."""
    return frozenset(as_layout(x) for x in layouts)


def _unavailable(name: str, spec: str, err: str) -> Backend:
    return Backend(
        name=name,
        contract_bearing=True,
        available=lambda: False,
        supports=lambda h, w: (False, err),
        description=f"unavailable ({err})",
        unavailable_reason=lambda: f"its plugin {spec} does not import: {err}",
    )


# Plugins of this repository, for a checkout that is not installed (an installed
# distribution declares the same specs as entry points).
BUILTIN_PLUGINS: dict[str, str] = {"pallas_sm90": "pallas_kernels.backend:backend_entry"}
ENTRY_POINT_GROUP = "detlogp_jax.backends"
_PLUGINS = PluginRegistry("backend", Backend, ENTRY_POINT_GROUP, BUILTIN_PLUGINS, _unavailable)
_REGISTRY, _LOADED = _PLUGINS.loaders, _PLUGINS.loaded  # name -> loader, name -> loaded entry
register, names, get, plugin_specs = _PLUGINS.register, _PLUGINS.names, _PLUGINS.get, _PLUGINS.plugin_specs


def available() -> tuple[str, ...]:
    out = []
    for n in _REGISTRY:
        try:
            if get(n).available():
                out.append(n)
        except Exception:  # a backend whose import fails is simply unavailable
            pass
    return tuple(out)


# --- strict mode ---------------------------------------------------------------
# Strict mode is part of every jit cache key (a JAX user context): a function traced
# outside `strict_mode()` and called inside it is traced again, and the new trace
# refuses what strict mode forbids. DETLOGP_STRICT is read at trace time too; a trace
# that strict mode would refuse also checks it at run time (`strict_guard`), so
# setting it after the first trace makes the cached call raise instead of serving.
_STRICT = jax.make_user_context(default_value=None)


def _env_strict() -> bool:
    return os.environ.get("DETLOGP_STRICT", "0").strip().lower() in ("1", "true", "yes", "on")


def is_strict() -> bool:
    """The `strict_mode()` context if one is active, else DETLOGP_STRICT."""
    value = _STRICT.value
    return _env_strict() if value is None else bool(value)


@contextlib.contextmanager
def strict_mode(enabled: bool = True):
    """Within this context only contract-bearing backends serve, with no fallback."""
    with _STRICT(bool(enabled)):
        yield


def guard_strict(backend: Backend, fallback: bool) -> None:
    """Called where a call's backend is chosen, inside the caller's trace. When strict
    mode would refuse this choice (a non-contract lane or a fallback) and only
    DETLOGP_STRICT decided (no `strict_mode()` context, whose value is in the jit
    key), adds a run-time check that raises StrictModeError at the call if
    DETLOGP_STRICT has been set since the trace. Strict-clean traces get no check."""
    if _STRICT.value is not None or (backend.contract_bearing and not fallback):
        return
    what = "a fallback to the reference backend" if fallback else f"the non-contract backend {backend.name!r}"

    def check():
        if _env_strict():
            raise StrictModeError(
                f"DETLOGP_STRICT is set, but this cached computation was traced without it and serves {what}"
            )

    jax.debug.callback(check)


def preferred() -> str:
    """The best contract-bearing backend for the default platform."""
    try:
        if get("pallas_sm90").available():
            return "pallas_sm90"
    except Exception:
        pass
    return "reference"


def resolve(
    requested: str, hidden, weight, weight_layout: WeightLayout | str = VD, *, entropy: bool = False
) -> tuple[Backend, bool]:
    """Picks the backend that serves a call. Returns (backend, fallback).

    A backend that cannot serve the call (unavailable here, refusing the operands or
    the layout, or, with `entropy`, not producing the entropy) raises
    BackendUnavailableError when it was requested explicitly (argument or
    DETLOGP_BACKEND), StrictModeError in strict mode, and otherwise (auto) falls back
    to the reference backend with a warning."""
    strict = is_strict()
    weight_layout = as_layout(weight_layout)
    if requested == "auto":
        requested = os.environ.get("DETLOGP_BACKEND", "auto") or "auto"
    target = preferred() if requested == "auto" else requested
    backend = get(target)
    if strict and not backend.contract_bearing:
        raise StrictModeError(
            f"backend {target!r} does not bear {C.CONTRACT_ID} (it materializes XLA logits with "
            "unpinned reductions); strict mode serves only contract-bearing backends"
        )
    reason = None
    if not backend.available():
        reason = f"backend {target!r} is not available on this machine: {backend.unavailable_reason()}"
    else:
        if weight_layout not in backend.layouts:
            ok, why = False, f"it does not read a weight_layout={weight_layout.name!r} weight in place"
        elif weight_layout is VD:
            ok, why = backend.supports(hidden, weight)
        else:  # a backend declaring another layout takes it as supports(..., weight_layout=)
            ok, why = backend.supports(hidden, weight, weight_layout=weight_layout)
        if ok and entropy and not backend.entropy:
            ok, why = False, f"it does not produce the entropy ({C.ENTROPY_ID}) that return_entropy=True asks for"
        if not ok:
            reason = f"backend {target!r} cannot serve this call: {why}"
    if reason is None:
        return backend, False
    if strict:
        raise StrictModeError(f"{reason}; strict mode forbids falling back")
    if requested != "auto":  # an explicit backend (argument or DETLOGP_BACKEND) never falls back
        raise BackendUnavailableError(f"{reason}; use backend='auto' to let the library choose")
    warnings.warn(f"{reason}; auto falls back to the reference backend", stacklevel=3)
    return get("reference"), True


# --- built-in backends -------------------------------------------------------------


def _reference() -> Backend:
    from detlogp_jax import reference

    return Backend(
        name="reference",
        contract_bearing=True,
        available=lambda: True,
        supports=lambda h, w, weight_layout=VD: (True, ""),
        partials=reference.partials,
        fold=reference.fold,
        layouts=frozenset({VD, DV}),
        description="plain JAX, any platform; sequential K walk; bit-exact vs the oracle on its logits",
        knobs=frozenset({"row_block"}),
        entropy=True,
    )


def _xla() -> Backend:
    from detlogp_jax import xla_backend

    return Backend(
        name="xla",
        contract_bearing=False,
        available=lambda: True,
        supports=lambda h, w, weight_layout=VD: (True, ""),
        forward=xla_backend.forward,
        layouts=frozenset({VD, DV}),
        description="materialized XLA logits + log_softmax: today's baseline, not batch-invariant",
        entropy=True,  # its own materialized entropy, not the contract's
    )


register("reference", _reference)
register("xla", _xla)
_PLUGINS.register_plugins()


def platform_info() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": getattr(dev, "device_kind", dev.platform),
        "compute_capability": getattr(dev, "compute_capability", None),
    }
