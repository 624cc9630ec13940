"""Backend registry, `auto` resolution and strict mode.

A backend is contract-bearing when its logp/lse are the oracle's function of
its own FP32 logits (`reference`, `pallas_sm90`). `xla` (materialized logits +
log_softmax) is the non-contract baseline lane. In strict mode only
contract-bearing backends may serve, and any fallback away from the requested
(or, for `auto`, the platform's preferred) backend raises `StrictModeError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os
import warnings
from typing import Any, Callable

import jax

from detlogp_jax import contract as C


class StrictModeError(RuntimeError):
    """Strict mode refused a non-contract backend or a fallback."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here or cannot serve this call."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registered backend.

    Contract-bearing backends provide `partials` and `fold` (see
    `detlogp_jax.reference` for the signatures); others provide `forward`
    (hidden, weight, bias, targets, inv_t, vocab_size, return_logits) ->
    (logp, lse, logits).
    """

    name: str
    contract_bearing: bool
    available: Callable[[], bool]
    supports: Callable[[Any, Any], tuple[bool, str]]
    partials: Callable | None = None
    fold: Callable | None = None
    forward: Callable | None = None
    description: str = ""
    knobs: frozenset = frozenset()  # the bit-neutral tuning knobs it applies

    def tuning_kwargs(self, tuning) -> dict:
        """The subset of bit-neutral `tuning` items this backend applies."""
        return {k: v for k, v in dict(tuning or ()).items() if k in self.knobs}


_REGISTRY: dict[str, Callable[[], Backend]] = {}
_LOADED: dict[str, Backend] = {}


def register(name: str, loader: Callable[[], Backend]) -> None:
    """Registers a backend lazily (its module is imported on first use)."""
    _REGISTRY[name] = loader
    _LOADED.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {sorted(_REGISTRY)} or 'auto'")
    if name not in _LOADED:
        _LOADED[name] = _REGISTRY[name]()
    return _LOADED[name]


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
_STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("detlogp_strict", default=None)


def is_strict() -> bool:
    value = _STRICT.get()
    if value is not None:
        return value
    return os.environ.get("DETLOGP_STRICT", "0").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def strict_mode(enabled: bool = True):
    """Within this context only contract-bearing backends serve, with no fallback."""
    token = _STRICT.set(enabled)
    try:
        yield
    finally:
        _STRICT.reset(token)


def preferred() -> str:
    """The best contract-bearing backend for the default platform."""
    try:
        if get("pallas_sm90").available():
            return "pallas_sm90"
    except Exception:
        pass
    return "reference"


def resolve(requested: str, hidden, weight) -> tuple[Backend, bool]:
    """Picks the backend that serves a call. Returns (backend, fallback)."""
    strict = is_strict()
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
        reason = f"backend {target!r} is not available on this machine"
    else:
        ok, why = backend.supports(hidden, weight)
        if not ok:
            reason = f"backend {target!r} cannot serve this call: {why}"
    if reason is None:
        return backend, False
    if strict:
        raise StrictModeError(f"{reason}; strict mode forbids falling back")
    if requested != "auto" and target != "reference":
        warnings.warn(f"{reason}; falling back to the reference backend", stacklevel=3)
    elif requested == "auto":
        warnings.warn(f"{reason}; auto falls back to the reference backend", stacklevel=3)
    return get("reference"), True


# --- built-in backends -------------------------------------------------------------


def _reference() -> Backend:
    from detlogp_jax import reference

    return Backend(
        name="reference",
        contract_bearing=True,
        available=lambda: True,
        supports=lambda h, w: (True, ""),
        partials=reference.partials,
        fold=reference.fold,
        description="plain JAX, any platform; sequential K walk; bit-exact vs the oracle on its logits",
        knobs=frozenset({"row_block"}),
    )


def _xla() -> Backend:
    from detlogp_jax import xla_backend

    return Backend(
        name="xla",
        contract_bearing=False,
        available=lambda: True,
        supports=lambda h, w: (True, ""),
        forward=xla_backend.forward,
        description="materialized XLA logits + log_softmax: today's baseline, not batch-invariant",
    )


def _pallas_sm90() -> Backend:
    mod = importlib.import_module("pallas_kernels")
    return Backend(
        name="pallas_sm90",
        contract_bearing=True,
        available=mod.is_available,
        supports=mod.supports,
        partials=mod.partials,
        fold=mod.fold,
        description="Pallas Mosaic GPU kernel for Hopper (sm_90): wgmma + TMA, fused streaming LSE",
        knobs=frozenset({"bucket", "num_ctas"}),
    )


def _safe_pallas() -> Backend:
    try:
        return _pallas_sm90()
    except Exception as e:  # not importable here: register as unavailable
        err = f"{type(e).__name__}: {e}"
        return Backend(
            name="pallas_sm90",
            contract_bearing=True,
            available=lambda: False,
            supports=lambda h, w: (False, err),
            description=f"unavailable ({err})",
        )


register("reference", _reference)
register("xla", _xla)
register("pallas_sm90", _safe_pallas)


def platform_info() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": getattr(dev, "device_kind", dev.platform),
        "compute_capability": getattr(dev, "compute_capability", None),
    }
