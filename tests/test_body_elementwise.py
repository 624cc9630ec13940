"""The body's pieces between the GEMMs and attention: RMSNorm (`body.rms_norm`, a pinned
reduction), and the element-wise ops as XLA builds them from plain jnp (SiLU gate, RoPE as
Tunix / Qwen3 write it, residual adds): a row's bytes must not depend on how many rows are
computed at once, on its place among them or on what the others hold. Element-wise ops can
still differ by shape where a compiler contracts or vectorizes differently; these tests would
show it (the GPU run of the same checks: tests/gpu/test_body_gpu.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from detlogp_jax import body
from tests.helpers import row_mismatches

MS = (1, 7, 64, 333)


def _rows_alone_vs_in_batches(fn, rows, ms=MS, seed=0):
    """fn applied to `rows` [R, ...] alone (each row as a batch of one) and inside batches of
    other sizes (placed at the end, after random neighbours): (mismatching rows, max diff)."""
    rng = np.random.default_rng(seed)
    alone = np.concatenate([np.asarray(fn(rows[i : i + 1]), np.float32) for i in range(rows.shape[0])])
    worst = (0, 0.0)
    for m in ms:
        if m < rows.shape[0]:
            continue
        others = jnp.asarray(rng.standard_normal((m - rows.shape[0],) + rows.shape[1:]), rows.dtype)
        got = np.asarray(fn(jnp.concatenate([others, rows])), np.float32)[m - rows.shape[0] :]
        worst = max(worst, row_mismatches(got, alone))
    return worst


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [32, 128, 4096])
def test_rms_norm_rows_are_invariant_and_close_to_flax(dtype, d):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, d)) * 3, dtype)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(d), dtype)
    assert _rows_alone_vs_in_batches(lambda a: body.rms_norm(a, scale), x)[0] == 0
    ref = nnx.RMSNorm(d, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    ref.scale[...] = scale
    got, want = np.asarray(body.rms_norm(x, scale), np.float64), np.asarray(ref(x), np.float64)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    x64 = np.asarray(x, np.float64)
    exact = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(scale, np.float64)
    assert np.abs(got - exact).max() <= tol * np.abs(exact).max()


def test_rms_norm_leading_axes_and_bad_input():
    x = jnp.ones((2, 3, 64), jnp.float32)
    assert body.rms_norm(x, jnp.ones(64)).shape == (2, 3, 64)
    with pytest.raises(ValueError, match="scale must be"):
        body.rms_norm(x, jnp.ones(63))
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        body.rms_norm(x.astype(jnp.float16), jnp.ones(64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_silu_gate_and_residual_add_as_xla_builds_them(dtype):
    rng = np.random.default_rng(2)
    g = jnp.asarray(rng.standard_normal((4, 2, 256)), dtype)  # rows of (gate, up)
    gate_up = jax.jit(lambda a: jax.nn.silu(a[:, 0]) * a[:, 1])
    assert _rows_alone_vs_in_batches(gate_up, g)[0] == 0
    resid = jax.jit(lambda a: a[:, 0] + a[:, 1])
    assert _rows_alone_vs_in_batches(resid, g)[0] == 0


def _rope(x, positions, max_wavelength=1_000_000.0):
    """RoPE as Tunix's Qwen3 writes it (plain jnp): x [B, T, H, Dh], positions [B, T]."""
    dh = x.shape[-1]
    fraction = 2 * jnp.arange(0, dh // 2) / dh
    timescale = max_wavelength**fraction
    inp = positions[..., None] / timescale[None, None, :]
    inp = inp[..., None, :]
    sin, cos = jnp.sin(inp), jnp.cos(inp)
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_as_xla_builds_it(dtype):
    """A token's rotated q / k at position p: alone, inside a longer sequence, in a batch of
    other sequences, at another batch index: the same bytes."""
    rng = np.random.default_rng(3)
    b, t, h, dh = 3, 300, 4, 128
    x = jnp.asarray(rng.standard_normal((b, t, h, dh)), dtype)
    pos = jnp.asarray(np.broadcast_to(np.arange(t), (b, t)) + np.array([[0], [5], [1000]]), jnp.int32)
    rope = jax.jit(_rope)
    full = np.asarray(rope(x, pos), np.float32)
    for bb, tt in ((0, 0), (1, 77), (2, 299)):
        one = np.asarray(rope(x[bb : bb + 1, tt : tt + 1], pos[bb : bb + 1, tt : tt + 1]), np.float32)
        assert row_mismatches(one[0], full[bb, tt : tt + 1])[0] == 0, (bb, tt)
    swapped = np.asarray(rope(x[::-1], pos[::-1]), np.float32)[::-1]
    assert row_mismatches(swapped.reshape(b * t, -1), full.reshape(b * t, -1))[0] == 0


def test_body_ops_are_differentiable_with_plain_backwards():
    """jax.grad through the invariant ops (their backward is XLA's plain formulation): matmul in
    both layouts, attention, rms_norm, against the XLA lane's / flax's gradients."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 6, 64)), jnp.float32)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
    wk, wn = jnp.asarray(rng.standard_normal((64, 96)) * 0.1), jnp.asarray(rng.standard_normal((96, 64)) * 0.1)

    def loss(x, scale, wk, wn, backend):
        h = body.rms_norm(x, scale) if backend == "reference" else nnx_rms(x, scale)
        a = body.matmul(h, wk, backend=backend)[..., :64]
        q = a.reshape(2, 6, 2, 32)
        o = body.attention(
            q, q[:, :, :1], q[:, :, 1:], q_positions=np.broadcast_to(np.arange(6), (2, 6)), backend=backend
        )
        return jnp.sum(jnp.tanh(body.matmul(o.reshape(2, 6, 64), wn, w_layout="nk", backend=backend)))

    def nnx_rms(x, scale):
        return (x * (jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale)).astype(x.dtype)

    got = jax.grad(loss, argnums=(0, 1, 2, 3))(x, scale, wk, wn, "reference")
    want = jax.grad(loss, argnums=(0, 1, 2, 3))(x, scale, wk, wn, "xla")
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)
