import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from detlogp_jax.fingerprint import (
    FingerprintMismatchError,
    check_fingerprints,
    weight_fingerprint,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_weight(dtype=np.float32, shape=(64, 32)):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def flip(a, flat_index, bit):
    a = np.array(a)
    u = a.view(np.dtype(f"uint{a.dtype.itemsize * 8}")).reshape(-1)
    u[flat_index] ^= u.dtype.type(1 << bit)
    return a


def test_same_bytes_same_fingerprint_including_jit():
    w, b = make_weight(), make_weight(shape=(64,))
    fp = weight_fingerprint(w, b)
    assert isinstance(fp, str) and len(fp) == 32 and int(fp, 16) >= 0
    assert weight_fingerprint(w.copy(), b.copy()) == fp
    assert weight_fingerprint(jnp.asarray(w), jnp.asarray(b)) == fp
    ident = jax.jit(lambda x: x + 0.0)  # produced on device by a jitted program
    assert weight_fingerprint(ident(jnp.asarray(w)), ident(jnp.asarray(b))) == fp
    assert weight_fingerprint(w) == weight_fingerprint(w, None) != fp


@pytest.mark.parametrize(
    "dtype,bits_",
    [(np.float32, (0, 13, 31)), (ml_dtypes.bfloat16, (0, 7, 15)), (np.float16, (0, 15)), (np.int8, (0, 7))],
)
def test_any_single_bit_flip_changes_it(dtype, bits_):
    w = make_weight(dtype)
    fp = weight_fingerprint(w)
    seen = {fp}
    for idx in (0, 1, 31, 32, 1000, w.size - 1):
        for bit in bits_:
            fpf = weight_fingerprint(flip(w, idx, bit))
            assert fpf not in seen
            seen.add(fpf)


def test_bias_bits_change_it():
    w, b = make_weight(), make_weight(shape=(64,))
    fp = weight_fingerprint(w, b)
    for idx in (0, 17, 63):
        assert weight_fingerprint(w, flip(b, idx, 0)) != fp
        assert weight_fingerprint(w, flip(b, idx, 31)) != fp
    assert weight_fingerprint(w, np.zeros(64, np.float32)) != weight_fingerprint(w)


def test_dtype_shape_position_and_signed_zero():
    w = make_weight()
    fp = weight_fingerprint(w)
    assert weight_fingerprint(w.view(np.int32)) != fp  # same bytes, other dtype
    assert weight_fingerprint(w.view(np.uint32)) != weight_fingerprint(w.view(np.int32))
    assert weight_fingerprint(w.reshape(32, 64)) != fp  # same bytes, other shape
    assert weight_fingerprint(w.reshape(-1)) != fp
    assert weight_fingerprint(w.T.copy()) != fp
    swapped = w.copy()
    swapped[0, 0], swapped[5, 3] = w[5, 3], w[0, 0]
    assert weight_fingerprint(swapped) != fp  # position dependent
    z = np.zeros((4, 4), np.float32)
    nz = z.copy()
    nz[2, 1] = -0.0
    assert weight_fingerprint(z) != weight_fingerprint(nz)
    assert weight_fingerprint(z) != weight_fingerprint(-z)
    # Weight/bias roles are not interchangeable.
    a, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    assert weight_fingerprint(a, b) != weight_fingerprint(b, a)


def test_supported_and_unsupported_dtypes():
    fps = {
        weight_fingerprint(np.zeros((8, 8), dt))
        for dt in (
            np.float32,
            np.float16,
            ml_dtypes.bfloat16,
            np.int8,
            np.uint8,
            np.bool_,
            ml_dtypes.float8_e4m3fn,
            np.int32,
        )
    }
    assert len(fps) == 8
    with pytest.raises(TypeError):
        weight_fingerprint(jnp.zeros((4,), jnp.int4))


def test_check_fingerprints():
    check_fingerprints("ab", "ab")
    with pytest.raises(FingerprintMismatchError) as e:
        check_fingerprints("aa11", "bb22", what="lm_head+bias")
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert "aa11" in msg and "bb22" in msg and "lm_head+bias" in msg


SHARDED = textwrap.dedent("""
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from detlogp_jax.fingerprint import weight_fingerprint
    assert len(jax.devices()) == 8
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    b = np.random.default_rng(0).standard_normal((64,)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    fps = set()
    for spec in (P("x", "y"), P("y", None), P(None, "x"), P()):
        ws = jax.device_put(w, NamedSharding(mesh, spec))
        bs = jax.device_put(b, NamedSharding(mesh, P(spec[0]) if spec else P()))
        fps.add(weight_fingerprint(ws, bs))
    fps.add(weight_fingerprint(jax.device_put(w, jax.devices()[5]), b))
    assert len(fps) == 1, fps
    print(fps.pop())
""")


def test_sharded_arrays_match_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    w, b = make_weight(), make_weight(shape=(64,))
    assert out.stdout.strip().splitlines()[-1] == weight_fingerprint(w, b)
