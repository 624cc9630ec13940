"""Strict mode, provenance, bad input and row-local faults, gradients, memory."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import detlogp_jax as dl
from detlogp_jax import contract as C
from tests.helpers import ROOT, assert_bitwise_equal, bits, f64_loss_grads

D, V, VOCAB = 32, 130, 128


def _data(n=6, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    h = np.asarray(rng.standard_normal((n, D))).astype(dtype)
    w = np.asarray(rng.standard_normal((V, D)) * 0.3).astype(dtype)
    t = rng.integers(0, VOCAB, n).astype(np.int32)
    return h, w, t


# --- strict mode and provenance ------------------------------------------------------


def test_strict_mode_refuses_xla_and_fallbacks():
    h, w, t = _data()
    with dl.strict_mode():
        with pytest.raises(dl.StrictModeError, match="does not bear"):
            dl.linear_logp(h, w, t, backend="xla")
        if jax.devices()[0].platform == "cpu":
            with pytest.raises(dl.StrictModeError, match="forbids falling back"):
                dl.linear_logp(h, w, t, backend="pallas_sm90")
        out = dl.linear_logp(h, w, t, backend="auto")
        prov = dl.last_provenance()
        assert prov.contract_bearing and not prov.fallback and prov.contract_id == dl.CONTRACT_ID
        assert np.isfinite(np.asarray(out.lse)).all()


def test_strict_mode_from_environment():
    code = (
        "import numpy as np, detlogp_jax as dl\n"
        "h=np.ones((2,8),np.float32); w=np.ones((4,8),np.float32); t=np.zeros(2,np.int32)\n"
        "try:\n    dl.linear_logp(h,w,t,backend='xla'); print('served')\n"
        "except dl.StrictModeError: print('refused')\n"
    )
    env = dict(os.environ, DETLOGP_STRICT="1", PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stderr[-2000:]


def test_provenance_record_contents():
    h, w, t = _data()
    prov = dl.provenance(h, w, vocab_size=VOCAB, padded_vocab_size=192)
    d = prov.as_dict()
    assert d["contract_id"] == "linear-logp-contract-v1" and d["n_split"] == C.n_split(192)
    assert d["jax_version"] == jax.__version__ and d["constants"]["TILE_V"] == 64
    dl.linear_logp(h, w, t, backend="xla")
    assert dl.last_provenance().contract_bearing is False


def test_tuning_cannot_override_contract_constants(monkeypatch):
    h, w, t = _data()
    with pytest.raises(dl.ContractError):
        dl.linear_logp(h, w, t, tuning={"TILE_V": 128})
    with pytest.raises(dl.ContractError):
        dl.linear_logp(h, w, t, tuning={"n_split": 4})
    monkeypatch.setenv("DETLOGP_TARGET_SPLITS", "8")
    with pytest.raises(dl.ContractError, match="DETLOGP_TARGET_SPLITS"):
        dl.linear_logp(h, w, t)


# --- bad input: clear errors at trace time ---------------------------------------------


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda h, w, t: (h[:, :-1], w, t), ValueError, "D mismatch"),
        (lambda h, w, t: (h, w[None], t), ValueError, r"\[V, D\] \(weight_layout=.vd.\)"),
        (lambda h, w, t: (h, w, t[:-1]), ValueError, "targets shape"),
        (lambda h, w, t: (h.astype(np.int32), w, t), TypeError, "bfloat16, float16 or float32"),
        (lambda h, w, t: (h.astype(jnp.bfloat16), w, t), TypeError, "share a dtype"),
        (lambda h, w, t: (h, w, t.astype(np.float32)), TypeError, "integer"),
        (lambda h, w, t: (h[0, :0], w[:, :0], np.zeros((), np.int32)), ValueError, "D must be"),
    ],
)
def test_shape_and_dtype_errors(mutate, exc, match):
    h, w, t = mutate(*_data())
    with pytest.raises(exc, match=match):
        dl.linear_logp(h, w, t)


def test_vocab_and_temperature_errors():
    h, w, t = _data()
    with pytest.raises(ValueError, match="vocab_size"):
        dl.linear_logp(h, w, t, vocab_size=V + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        dl.linear_logp(h, w, t, vocab_size=0)
    with pytest.raises(ValueError, match="padded_vocab_size"):
        dl.linear_logp(h, w, t, padded_vocab_size=V - 1)
    for bad_t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            dl.linear_logp(h, w, t, temperature=bad_t)
    with pytest.raises(ValueError, match="temperature"):
        dl.linear_logp(h, w, t, temperature=jnp.asarray([1.0, 0.0, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match="temperature"):
        dl.linear_logp(h, w, t, temperature=jnp.ones((3,)))
    with pytest.raises(ValueError, match="bias"):
        dl.linear_logp(h, w, t, bias=jnp.zeros((V - 1,)))
    with pytest.raises(ValueError, match="unknown backend"):
        dl.linear_logp(h, w, t, backend="cuda")


def test_traced_nonpositive_temperature_is_row_local():
    h, w, t = _data()
    temps = jnp.asarray([1.0, 0.0, 1.0, -2.0, 1.0, 1.0], jnp.float32)
    f = jax.jit(lambda temp: dl.linear_logp(h, w, t, temperature=temp, vocab_size=VOCAB, backend="reference"))
    out = f(temps)
    ref = dl.linear_logp(h, w, t, vocab_size=VOCAB, backend="reference")
    good = np.array([0, 2, 4, 5])
    assert_bitwise_equal(np.asarray(out.logp)[good], np.asarray(ref.logp)[good])
    assert np.isnan(np.asarray(out.lse)[[1, 3]]).all()


# --- row-local faults ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_bad_target_is_row_local_nan(backend):
    h, w, t = _data()
    t_bad = t.copy()
    t_bad[1], t_bad[3], t_bad[4] = -5, VOCAB, -100
    ok = dl.linear_logp(h, w, t, vocab_size=VOCAB, backend=backend)
    out = dl.linear_logp(h, w, t_bad, vocab_size=VOCAB, backend=backend)
    lp = np.asarray(out.logp)
    assert np.isnan(lp[1]) and np.isnan(lp[3]) and bits(lp[4]) == bits(np.float32(0.0))
    keep = [0, 2, 5]
    assert_bitwise_equal(lp[keep], np.asarray(ok.logp)[keep])
    assert_bitwise_equal(out.lse, ok.lse)  # lse does not depend on targets


def test_checked_mode_raises_on_bad_targets(monkeypatch):
    h, w, t = _data()
    t[2] = VOCAB + 3
    with pytest.raises(ValueError, match="outside"):
        dl.linear_logp(h, w, t, vocab_size=VOCAB, checked=True)
    monkeypatch.setenv("DETLOGP_CHECKED", "1")
    with pytest.raises(ValueError, match="outside"):
        dl.linear_logp(h, w, t, vocab_size=VOCAB)
    t[2] = -100
    dl.linear_logp(h, w, t, vocab_size=VOCAB)  # ignore_index is fine


def test_checked_mode_under_jit_names_the_bad_target():
    """Under jax.jit checked mode runs through checkify: checkified, a bad target raises a plain
    message naming it and the vocabulary; a trace that is not checkified is refused at trace
    time saying what to do (never an XLA runtime error of a host callback)."""
    from jax.experimental import checkify

    h, w, t = _data()
    t[2] = VOCAB + 3
    f = jax.jit(lambda h, t: dl.linear_logp(h, w, t, vocab_size=VOCAB, checked=True).logp)
    with pytest.raises(ValueError, match="checkify"):
        f(h, t)
    err, _ = checkify.checkify(f)(h, t)
    with pytest.raises(Exception, match=rf"target {VOCAB + 3} at index 2 is outside \[0, {VOCAB}\)"):
        err.throw()
    t[2] = -100
    err, out = checkify.checkify(f)(h, t)
    err.throw()  # no error: ignore_index is fine
    assert np.isfinite(np.asarray(out)[np.arange(len(t)) != 2]).all()


def test_nan_and_inf_rows_do_not_touch_other_rows():
    h, w, t = _data(n=9)
    ok = dl.linear_logp(h, w, t, vocab_size=VOCAB, backend="reference", return_logits=True)
    h2 = h.copy()
    h2[2, 5] = np.nan
    h2[6, 0] = np.inf
    out = dl.linear_logp(h2, w, t, vocab_size=VOCAB, backend="reference", return_logits=True)
    keep = [0, 1, 3, 4, 5, 7, 8]
    for a, b in ((out.logp, ok.logp), (out.lse, ok.lse), (out.logits, ok.logits)):
        assert_bitwise_equal(np.asarray(a)[keep], np.asarray(b)[keep])
    assert np.isnan(np.asarray(out.lse)[2])


def test_empty_batch():
    h, w, _ = _data()
    out = dl.linear_logp(h[:0], w, np.zeros((0,), np.int32), return_logits=True)
    assert out.logp.shape == (0,) and out.logits.shape == (0, V)


# --- gradients vs float64 autodiff --------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_float64(dtype):
    rng = np.random.default_rng(11)
    n = 12
    h, w, t = _data(n=n, dtype=dtype, seed=11)
    t[3] = -100
    b = rng.standard_normal(V).astype(np.float32) * 0.1
    g_lp = rng.standard_normal(n).astype(np.float32)
    g_lse = rng.standard_normal(n).astype(np.float32)
    temp = 0.8

    def loss(h, w, b):
        out = dl.linear_logp(h, w, t, bias=b, temperature=temp, vocab_size=VOCAB, backend="reference")
        return jnp.sum(out.logp * g_lp) + jnp.sum(out.lse * g_lse)

    gh, gw, gb = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(h), jnp.asarray(w), jnp.asarray(b))
    eh, ew, eb = f64_loss_grads(h, w, b, t, temp, VOCAB, g_lp, g_lse)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for got, want in ((gh, eh), (gw, ew), (gb, eb)):
        got = np.asarray(got, np.float64)
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel < tol, rel
    assert np.abs(np.asarray(gw, np.float32)[VOCAB:]).max() == 0  # padding rows get nothing
    # deterministic: a second run gives identical gradient bytes
    gh2, gw2, gb2 = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(h), jnp.asarray(w), jnp.asarray(b))
    assert_bitwise_equal(np.asarray(gh2, np.float32), np.asarray(gh, np.float32))
    assert_bitwise_equal(np.asarray(gw2, np.float32), np.asarray(gw, np.float32))


def test_gradient_through_returned_logits():
    h, w, t = _data(n=4)

    def loss(h, w):
        out = dl.linear_logp(h, w, t, vocab_size=VOCAB, return_logits=True, backend="reference")
        return jnp.sum(out.logits[:, :5] ** 2)

    def loss_xla(h, w):
        return jnp.sum((h @ w.T)[:, :5] ** 2)

    g = jax.grad(loss, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
    e = jax.grad(loss_xla, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
    for a, b in zip(g, e):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


# --- memory of the trainer path (compiled, not run) ----------------------------------------


def test_trainer_path_never_allocates_n_by_v():
    n, d, v, vocab = 4096, 4096, 152064, 151936
    h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    fn = jax.jit(lambda h, w, t: dl.linear_logp(h, w, t, vocab_size=vocab, backend="reference")[:2])
    mem = fn.lower(h, w, t).compile().memory_analysis()
    logits_bytes = n * v * 4
    assert mem.temp_size_in_bytes < 0.05 * logits_bytes, (mem.temp_size_in_bytes, logits_bytes)
    # the XLA baseline does materialize it (the check can tell the difference)
    fx = jax.jit(lambda h, w, t: dl.linear_logp(h, w, t, vocab_size=vocab, backend="xla")[:2])
    assert fx.lower(h, w, t).compile().memory_analysis().temp_size_in_bytes >= logits_bytes


def test_bit_neutral_knobs_apply_per_backend_and_change_no_bits():
    h, w, t = _data(n=10)
    base = dl.linear_logp(h, w, t, vocab_size=VOCAB, backend="reference")
    for tuning in ({"row_block": 3}, {"row_block": 7}, {"bucket": "decode", "num_ctas": 4}):
        out = dl.linear_logp(h, w, t, vocab_size=VOCAB, backend="reference", tuning=tuning)
        assert_bitwise_equal(out.logp, base.logp, f"logp with {tuning}")
        assert_bitwise_equal(out.lse, base.lse, f"lse with {tuning}")


def test_gradients_qwen_size_vocab_match_float64():
    """Qwen3 vocab (151936 real, 152064 padded rows) at small D: logp and lse gradients."""
    rng = np.random.default_rng(12)
    n, d, v_pad, vocab = 5, 16, 152064, 151936
    h = rng.standard_normal((n, d)).astype(np.float32)
    w = (rng.standard_normal((v_pad, d)) * 0.3).astype(np.float32)
    b = (rng.standard_normal(v_pad) * 0.1).astype(np.float32)
    t = np.array([0, vocab - 1, -100, 75000, 151935], np.int32)
    g_lp = rng.standard_normal(n).astype(np.float32)
    g_lse = rng.standard_normal(n).astype(np.float32)

    def loss(h, w, b):
        out = dl.linear_logp(h, w, t, bias=b, temperature=1.3, vocab_size=vocab, backend="reference")
        return jnp.sum(out.logp * g_lp) + jnp.sum(out.lse * g_lse)

    got = jax.grad(loss, argnums=(0, 1, 2))(h, w, b)
    want = f64_loss_grads(h, w, b, t, 1.3, vocab, g_lp, g_lse)
    for g, e in zip(got, want):
        g = np.asarray(g, np.float64)
        assert np.linalg.norm(g - e) / np.linalg.norm(e) < 1e-5
    assert np.abs(np.asarray(got[1])[vocab:]).max() == 0 and np.abs(np.asarray(got[2])[vocab:]).max() == 0
