"""One rule for the body ops' gradients: the invariant forward, the plain formulation's backward.

A trainer needs the bytes of the body's forward to equal the rollout's; its gradients need to be
correct, not batch invariant. So each invariant body op (the reference formulations, whose
pinned ops' bit casts have no derivative, and the Hopper kernels, which have no VJP) is
differentiated as its plain jnp formulation: XLA's GEMMs, the einsum-softmax attention, RMSNorm
in f32 (deterministic run to run, not invariant).
"""

from __future__ import annotations

from typing import Callable

import jax

__all__ = ["with_plain_backward"]


def with_plain_backward(forward: Callable, plain: Callable, *args):
    """forward(*args), differentiated as plain(*args): a custom VJP whose forward is `forward`'s
    bytes and whose backward is `jax.vjp(plain, *args)`. args are the arrays (integer arrays
    get zero cotangents); static arguments are closed over by both functions."""

    @jax.custom_vjp
    def op(*a):
        return forward(*a)

    def fwd(*a):
        return forward(*a), a

    def bwd(a, g):
        return jax.vjp(plain, *a)[1](g)

    op.defvjp(fwd, bwd)
    return op(*args)
