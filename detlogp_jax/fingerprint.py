"""Deterministic on-device fingerprints of the lm_head (and bias) bytes.

Contract of :func:`weight_fingerprint`:

* It is a function of the arrays' raw element bits, dtype and shape only: equal for
  byte-identical arrays on any backend, device or sharding (also under ``jit`` of the
  caller's program: the hash is exact integer arithmetic).
* Any change of a single element's bits (e.g. ``-0.0`` vs ``0.0``, one flipped bit,
  another NaN payload), of the dtype, of the shape, or presence/absence of the bias
  changes it (single-element changes are guaranteed to change every lane; other changes
  collide with probability about ``2**-128``).
* It is not a cryptographic hash: it detects accidents, not adversaries.

Algorithm (version ``v1``): each element is bitcast to an unsigned integer of its own
width and widened to a ``uint32`` word ``w`` (64-bit elements give two words along a
new trailing axis). For each of 4 lanes a position hash ``P`` is built from the element's
N-d index (a 32-bit mixer chained over the axes, seeded per lane) and the lane value is
``mix(w ^ P)``, a bijection of ``w`` for a fixed position. Lanes are reduced with
wrapping ``uint32`` sums, which are exact, associative and commutative, so the result
cannot depend on reduction order or sharding. The host then hashes the 128 lane bits with
dtype and shape (BLAKE2b, 16 bytes) into the hex string.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["weight_fingerprint", "check_fingerprints", "FingerprintMismatchError"]

_VERSION = b"detlogp-fingerprint-v1"
_LANE_SEEDS = (0x9E3779B9, 0x7F4A7C15, 0x2545F491, 0x6A09E667)


class FingerprintMismatchError(ValueError):
    """The weights a logp was computed with are not the weights expected."""


def _mix32(x):
    """Bijective 32-bit avalanche mixer (xorshift-multiply, MurmurHash3 finalizer)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x):
    """Element bits as ``uint32`` words (one per element; two for 64-bit elements)."""
    dt = x.dtype
    if dt == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(dt, jnp.integer):
        bits = jnp.iinfo(dt).bits
    elif jnp.issubdtype(dt, jnp.floating):
        bits = jnp.finfo(dt).bits
    else:
        raise TypeError(f"unsupported dtype for fingerprinting: {dt}")
    if bits not in (8, 16, 32, 64):
        raise TypeError(f"unsupported dtype for fingerprinting: {dt} ({bits} bits)")
    u = lax.bitcast_convert_type(x, jnp.dtype(f"uint{min(bits, 32)}"))
    return u.astype(jnp.uint32)


@jax.jit
def _lanes(x):
    w = _words(x)
    out = []
    for seed in _LANE_SEEDS:
        pos = jnp.uint32(seed)
        for axis in range(w.ndim):
            idx = lax.broadcasted_iota(jnp.uint32, (w.shape[axis],) + (1,) * (w.ndim - 1 - axis), 0)
            pos = _mix32(pos ^ idx) + jnp.uint32(seed)
        lane = _mix32((w ^ pos) * jnp.uint32(0x27D4EB2F) + jnp.uint32(seed))
        out.append(jnp.sum(lane, dtype=jnp.uint32))
    return jnp.stack(out)


def _digest_part(name: str, x) -> bytes:
    x = jnp.asarray(x)
    lanes = _lanes(x)
    lanes = np.asarray(lanes.addressable_data(0), dtype="<u4")  # replicated result
    header = f"{name}|{jnp.dtype(x.dtype).name}|{tuple(int(d) for d in x.shape)}|".encode()
    return len(header).to_bytes(4, "little") + header + lanes.tobytes()


def weight_fingerprint(weight, bias: Optional[jax.Array] = None) -> str:
    """Hex fingerprint (32 chars) of ``weight`` and optional ``bias`` bits, dtype, shape.

    Accepts NumPy or JAX arrays, including sharded global arrays (the hash is computed
    where the data lives; only 16 bytes per array come back to the host).
    """
    h = hashlib.blake2b(_VERSION, digest_size=16)
    h.update(_digest_part("weight", weight))
    h.update(b"\0no-bias" if bias is None else _digest_part("bias", bias))
    return h.hexdigest()


def check_fingerprints(expected: str, actual: str, *, what: str = "lm_head") -> None:
    """Raise :class:`FingerprintMismatchError` naming both fingerprints if they differ."""
    if expected != actual:
        raise FingerprintMismatchError(f"{what} fingerprint mismatch: expected {expected}, got {actual}")
