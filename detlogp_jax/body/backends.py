"""The body's backend registry: which implementation serves `body.matmul` / `body.attention`.

A body backend is *invariant* when a row's output bytes never depend on the batch around it
(M, the row's position, padding rows, the other rows' values; for attention: prefill vs
decode, padding of the cache): "reference" (plain JAX, fixed-order formulations, any
platform) and "pallas_sm90" (Hopper kernels). "xla" (plain jnp) is the non-invariant
baseline lane.

Resolution follows the operator's rules (`detlogp_jax.backends.resolve`), with the same
strict mode (`detlogp_jax.strict_mode()` / DETLOGP_STRICT):

* "auto": per op, "pallas_sm90" where it is available here and has the op, else "reference";
  if the chosen backend cannot serve these operands, auto falls back to "reference" with a
  warning.
* an explicit name that cannot serve (unavailable here, no such op, operands refused)
  raises `BackendUnavailableError`; it never falls back.
* strict mode refuses a non-invariant backend ("xla") and any fallback (`StrictModeError`),
  and guards cached traces made without it (`detlogp_jax.backends.guard_strict`).

The op core never imports a backend package: "pallas_sm90" is a plugin named by a
`module:attribute` spec (`BUILTIN_PLUGINS`, or the `detlogp_jax.body_backends` entry-point
group of an installed distribution) whose function returns its `BodyBackend`; it is imported
on first use, and a plugin that does not import is registered as unavailable with the import
error as its reason.

The built-in entries take their ops from the op modules by these names (an op module or name
that is missing leaves the op unserved): `detlogp_jax.body.gemm`: `reference_matmul`,
`reference_supports_matmul`, `xla_matmul`, `xla_supports_matmul`;
`detlogp_jax.body.kv_attention`: `reference_attention`, `reference_supports_attention`,
`xla_attention`, `xla_supports_attention`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import warnings
from typing import Callable

from detlogp_jax import backends as core
from detlogp_jax.backends import BackendUnavailableError, StrictModeError
from detlogp_jax.registry import PluginRegistry

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "OPS",
    "BackendUnavailableError",
    "BodyBackend",
    "StrictModeError",
    "get",
    "names",
    "preferred",
    "register",
    "resolve",
]

OPS = ("matmul", "attention")


@dataclasses.dataclass(frozen=True)
class BodyBackend:
    """One registered body backend.

    matmul(x2 [M, K], w, *, w_layout: str, out_dtype) -> [M, N], operands already validated
    by `body.matmul`; supports_matmul(x2, w, w_layout) -> (ok, why).
    attention(q, k, v, *, q_positions, kv_start, scale, out_dtype) -> [B, T, Hq, Dh], arrays
    already validated by `body.attention`; supports_attention(q, k, v) -> (ok, why).
    An op left None is not served by this backend.
    """

    name: str
    invariant: bool  # a row's bytes never depend on the batch (module docstring)
    available: Callable[[], bool]
    unavailable_reason: Callable[[], str] = lambda: "not available on this machine"
    matmul: Callable | None = None
    supports_matmul: Callable | None = None
    attention: Callable | None = None
    supports_attention: Callable | None = None
    description: str = ""

    @property
    def contract_bearing(self) -> bool:
        """The operator registry's word for `invariant` (read by `detlogp_jax.backends.guard_strict`)."""
        return self.invariant

    def serves(self, op: str, *operands) -> tuple[bool, str]:
        """(ok, why): whether this backend has `op` and takes these operands."""
        fn = getattr(self, op)
        if fn is None:
            return False, f"it has no {op}"
        supports = getattr(self, f"supports_{op}")
        return (True, "") if supports is None else supports(*operands)


def _unavailable(name: str, spec: str, err: str) -> BodyBackend:
    return BodyBackend(
        name=name,
        invariant=True,
        available=lambda: False,
        unavailable_reason=lambda: f"its plugin {spec} does not import: {err}",
        description=f"unavailable ({err})",
    )


# Plugins of this repository, for a checkout that is not installed (an installed
# distribution declares the same specs as entry points of ENTRY_POINT_GROUP).
BUILTIN_PLUGINS: dict[str, str] = {"pallas_sm90": "pallas_kernels.body:body_entry"}
ENTRY_POINT_GROUP = "detlogp_jax.body_backends"
_PLUGINS = PluginRegistry("body backend", BodyBackend, ENTRY_POINT_GROUP, BUILTIN_PLUGINS, _unavailable)
register, names, get, plugin_specs = _PLUGINS.register, _PLUGINS.names, _PLUGINS.get, _PLUGINS.plugin_specs


def preferred(op: str) -> str:
    """What "auto" asks for first for `op`: "pallas_sm90" where it is available here and has
    the op, else "reference"."""
    try:
        gpu = get("pallas_sm90")
        if gpu.available() and getattr(gpu, op) is not None:
            return "pallas_sm90"
    except Exception:  # a broken plugin is simply not preferred
        pass
    return "reference"


def resolve(op: str, requested: str, *operands) -> BodyBackend:
    """The backend that serves `op` ("matmul" | "attention") on `operands` (see the module
    docstring for "auto", explicit names and strict mode). Call it inside the caller's trace:
    strict mode's run-time guard is added there."""
    if op not in OPS:
        raise ValueError(f"unknown body op {op!r}; known: {OPS}")
    if not isinstance(requested, str):
        raise TypeError(f"backend must be a body backend name or 'auto', got {requested!r}")
    strict = core.is_strict()
    target = preferred(op) if requested == "auto" else requested
    backend = get(target)
    if strict and not backend.invariant:
        raise StrictModeError(
            f"body backend {target!r} is not batch invariant (a row's bytes may change with the batch); "
            "strict mode serves only invariant body backends"
        )
    if not backend.available():
        reason = f"body backend {target!r} is not available on this machine: {backend.unavailable_reason()}"
    else:
        ok, why = backend.serves(op, *operands)
        reason = None if ok else f"body backend {target!r} cannot serve this {op}: {why}"
    if reason is None:
        core.guard_strict(backend, False)
        return backend
    if strict:
        raise StrictModeError(f"{reason}; strict mode forbids falling back")
    if requested != "auto":
        raise BackendUnavailableError(f"{reason}; use backend='auto' to let the library choose")
    fallback = get("reference")
    ok, why = fallback.serves(op, *operands)
    if not ok:
        raise BackendUnavailableError(f"{reason}, and the reference backend cannot either: {why}")
    warnings.warn(f"{reason}; auto falls back to the reference backend", stacklevel=3)
    core.guard_strict(fallback, True)
    return fallback


# --- built-in backends ------------------------------------------------------------------


def _op_functions(module: str, prefix: str, op: str) -> dict:
    """{op: module.<prefix>_<op>, supports_<op>: module.<prefix>_supports_<op>}, None where the
    module (not yet part of this checkout) or the name is missing."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        mod = None
    return {
        op: getattr(mod, f"{prefix}_{op}", None),
        f"supports_{op}": getattr(mod, f"{prefix}_supports_{op}", None),
    }


def _builtin(prefix: str) -> dict:
    ops = _op_functions("detlogp_jax.body.gemm", prefix, "matmul")
    ops.update(_op_functions("detlogp_jax.body.kv_attention", prefix, "attention"))
    return ops


def _reference() -> BodyBackend:
    return BodyBackend(
        name="reference",
        invariant=True,
        available=lambda: True,
        description="plain JAX, any platform: fixed-order formulations (one f32 accumulator, K ascending)",
        **_builtin("reference"),
    )


def _xla() -> BodyBackend:
    return BodyBackend(
        name="xla",
        invariant=False,
        available=lambda: True,
        description="plain jnp (XLA's dot and attention): the non-invariant baseline lane",
        **_builtin("xla"),
    )


register("reference", _reference)
register("xla", _xla)
_PLUGINS.register_plugins()
