"""LogpHead (Flax NNX): op parity, nnx.jit/nnx.grad/nnx.Optimizer training, determinism."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from detlogp_jax import linear_logp
from detlogp_jax.apps.toy_lm import ToyLM, ToyLMConfig, shifted_targets
from detlogp_jax.flax import LogpHead
from tests.helpers import assert_bitwise_equal

V, D = 300, 32


def _data(n=12, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    h = jax.random.normal(k1, (n, D), jnp.float32)
    t = jax.random.randint(k2, (n,), 0, V).at[3].set(-100)
    return h, t


def test_head_routes_to_linear_logp_bitwise():
    head = LogpHead(D, V, use_bias=True, backend="reference", rngs=nnx.Rngs(0))
    head.bias[...] = jax.random.normal(jax.random.PRNGKey(5), (V,)) * 0.1
    assert head.kernel.shape == (V, D) and head.padded_vocab_size == 512
    h, t = _data()
    out = head(h, t, temperature=0.7, return_logits=True)
    ref = linear_logp(
        h,
        head.kernel[...],
        t,
        bias=head.bias[...],
        temperature=0.7,
        vocab_size=V,
        padded_vocab_size=512,
        return_logits=True,
        backend="reference",
    )
    assert_bitwise_equal(out.logp, ref.logp, "logp")
    assert_bitwise_equal(out.lse, ref.lse, "lse")
    assert_bitwise_equal(out.logits, ref.logits, "logits")
    assert float(out.logp[3]) == 0.0  # ignore_index
    # Under nnx.jit, same bytes.
    jitted = nnx.jit(lambda m, h, t: m(h, t, temperature=0.7).logp)(head, h, t)
    assert_bitwise_equal(jitted, ref.logp, "jit logp")


def test_head_returns_the_ops_entropy_and_its_gradient():
    head = LogpHead(D, V, use_bias=True, backend="reference", rngs=nnx.Rngs(0))
    h, t = _data()
    out = head(h, t, temperature=0.9, return_entropy=True)
    ref = linear_logp(
        h,
        head.kernel[...],
        t,
        bias=head.bias[...],
        temperature=0.9,
        vocab_size=V,
        padded_vocab_size=512,
        backend="reference",
        return_entropy=True,
    )
    assert_bitwise_equal(out.entropy, ref.entropy, "entropy")
    assert_bitwise_equal(out.logp, head(h, t, temperature=0.9).logp, "logp with and without the entropy")
    assert head(h, t).entropy is None
    # an entropy bonus trains through nnx.grad
    g = nnx.grad(lambda m: m.loss(h, t) - 0.01 * jnp.mean(m(h, t, return_entropy=True).entropy))(head)
    assert np.isfinite(np.asarray(g.weight[...])).all() and float(jnp.abs(g.weight[...]).max()) > 0


def test_padded_weight_same_bytes():
    a = LogpHead(D, V, backend="reference", rngs=nnx.Rngs(0))
    b = LogpHead(D, V, pad_weight=True, backend="reference", rngs=nnx.Rngs(0))
    assert b.kernel.shape == (512, D)
    b.kernel[...] = jnp.pad(a.kernel[...], ((0, 512 - V), (0, 0)))
    h, t = _data()
    assert_bitwise_equal(a(h, t).logp, b(h, t).logp, "padded weight")


def test_tied_embedding_shares_param():
    emb = nnx.Embed(V, D, rngs=nnx.Rngs(1))
    head = LogpHead(tied_embedding=emb, backend="reference")
    assert head.kernel is emb.embedding and head.vocab_size == V and head.in_features == D
    h, t = _data()
    ref = linear_logp(h, emb.embedding[...], t, vocab_size=V, padded_vocab_size=512, backend="reference")
    assert_bitwise_equal(head(h, t).logp, ref.logp, "tied")


def test_dtype_cast_and_errors():
    head = LogpHead(D, V, param_dtype=jnp.bfloat16, backend="xla", rngs=nnx.Rngs(0))
    h, t = _data()
    # f32 hidden is cast to the bf16 weight (linear_logp itself refuses mixed dtypes)
    want = linear_logp(h.astype(jnp.bfloat16), head.kernel[...], t, vocab_size=V, padded_vocab_size=512, backend="xla")
    assert_bitwise_equal(head(h, t).logp, want.logp, "cast to the weight dtype")
    with pytest.raises(ValueError):
        LogpHead(D, V)  # no rngs
    with pytest.raises(ValueError):
        LogpHead(D, V, mesh=jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",)), rngs=nnx.Rngs(0))  # no tp_axis


@pytest.mark.slow
def test_mesh_routes_to_tp_entry():
    """With mesh/tp_axis the head pads its weight to V_pad and calls sharding.linear_logp_tp
    (here a 1-device mesh: same bytes as the unsharded head)."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    head = LogpHead(D, V, mesh=mesh, tp_axis="tp", backend="reference", rngs=nnx.Rngs(0))
    h, t = _data()
    plain = LogpHead(D, V, backend="reference", rngs=nnx.Rngs(0))
    assert head.kernel.shape == (512, D)
    np.testing.assert_array_equal(np.asarray(head.kernel[...])[:V], np.asarray(plain.kernel[...]))
    a, b = head(h, t, return_logits=True), plain(h, t, return_logits=True)
    assert_bitwise_equal(a.logp, b.logp, "tp logp")
    assert_bitwise_equal(a.logits, b.logits, "tp logits")
    g = nnx.grad(lambda m: m.loss(h, t))(head)
    gp = nnx.grad(lambda m: m.loss(h, t))(plain)
    np.testing.assert_allclose(np.asarray(g.weight[...])[:V], np.asarray(gp.weight[...]), rtol=1e-5, atol=1e-7)


# ---- training a tiny decoder LM -------------------------------------------------------

CFG = dict(vocab_size=V, d_model=D, n_layers=1, n_heads=2, d_ff=64, max_len=16, head_bias=True)


def _train(backend, steps=4, seed=0, tie=False):
    cfg = ToyLMConfig(backend=backend, tie_embeddings=tie, **CFG)
    model = ToyLM(cfg, rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (4, 16), 0, V)
    targets = shifted_targets(tokens, prompt_len=3)  # prompt and last position ignored

    @nnx.jit
    def step(model, opt, tokens, targets):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens, targets))(model)
        opt.update(model, grads)
        return loss, grads

    losses, g0 = [], None
    for i in range(steps):
        loss, grads = step(model, opt, tokens, targets)
        losses.append(float(loss))
        if i == 0:
            g0 = nnx.state(grads)
    return np.asarray(losses), g0, model


@pytest.fixture(scope="module")
def runs():
    return {"reference": _train("reference"), "xla": _train("xla")}


def test_loss_decreases_and_matches_xla_head(runs):
    ref_losses, ref_g, _ = runs["reference"]
    xla_losses, xla_g, _ = runs["xla"]
    assert ref_losses[-1] < ref_losses[0] - 0.5, ref_losses
    np.testing.assert_allclose(ref_losses, xla_losses, rtol=1e-4)
    flat_r = jax.tree_util.tree_leaves_with_path(ref_g)
    flat_x = dict(jax.tree_util.tree_leaves_with_path(xla_g))
    assert len(flat_r) == len(flat_x) > 10
    for path, g in flat_r:
        gx = flat_x[path]
        scale = float(jnp.max(jnp.abs(gx))) + 1e-12
        np.testing.assert_allclose(np.asarray(g), np.asarray(gx), rtol=1e-3, atol=1e-3 * scale, err_msg=str(path))
    # The head's weight and bias got gradients.
    paths = {jax.tree_util.keystr(p) for p, _ in flat_r}
    assert any("head" in p and "weight" in p for p in paths) and any("head" in p and "bias" in p for p in paths)


def test_training_is_deterministic(runs):
    _, _, m1 = runs["reference"]
    _, _, m2 = _train("reference")
    s1 = jax.tree_util.tree_leaves_with_path(nnx.state(m1, nnx.Param))
    s2 = dict(jax.tree_util.tree_leaves_with_path(nnx.state(m2, nnx.Param)))
    for path, a in s1:
        b = s2[path]
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path


def test_tied_model_trains():
    losses, g0, model = _train("reference", steps=3, tie=True)
    assert losses[-1] < losses[0]
    assert model.head.kernel is model.embed.embedding


# ---- [D, V] kernels: an own "dv" weight, or an existing nnx.Linear, read in place ---------


def test_dv_head_and_wrapped_linear_give_the_vd_bytes():
    h, t = _data()
    vd = LogpHead(D, V, use_bias=True, backend="reference", rngs=nnx.Rngs(0))
    vd.bias[...] = jax.random.normal(jax.random.PRNGKey(5), (V,)) * 0.1
    dv = LogpHead(D, V, use_bias=True, backend="reference", weight_layout="dv", rngs=nnx.Rngs(1))
    assert dv.kernel.shape == (D, V) and dv.weight_layout == "dv"
    dv.kernel[...] = vd.kernel[...].T
    dv.bias[...] = vd.bias[...]
    lin = nnx.Linear(D, V, use_bias=True, rngs=nnx.Rngs(2))
    lin.kernel[...] = vd.kernel[...].T
    lin.bias[...] = vd.bias[...]
    wrapped = LogpHead(linear=lin, backend="reference")
    assert wrapped.kernel is lin.kernel and wrapped.bias is lin.bias  # shared Params, no copy
    want = vd(h, t, temperature=0.7, return_logits=True)
    for head in (dv, wrapped):
        got = head(h, t, temperature=0.7, return_logits=True)
        for a, b, what in zip(got[:3], want[:3], ("logp", "lse", "logits")):
            assert_bitwise_equal(a, b, what)
        assert head.fingerprint() == vd.fingerprint()  # one weight version in either layout
    # gradients land in the linear layer's own [D, V] kernel
    g = nnx.grad(lambda m: m.loss(h, t))(wrapped)
    gv = nnx.grad(lambda m: m.loss(h, t))(vd)
    np.testing.assert_allclose(np.asarray(g.linear.kernel[...]).T, np.asarray(gv.weight[...]), rtol=1e-5, atol=1e-7)


def test_wrapping_a_linear_layer_checks_its_shape():
    lin = nnx.Linear(D, V, use_bias=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features"):
        LogpHead(D + 1, linear=lin)
    with pytest.raises(ValueError, match="no bias"):
        LogpHead(linear=lin, use_bias=True)
    with pytest.raises(TypeError, match="nnx.Linear"):
        LogpHead(linear=nnx.Embed(V, D, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="weight_layout"):
        LogpHead(D, V, weight_layout="kd", rngs=nnx.Rngs(0))


def test_dv_head_on_a_tp_mesh_matches_the_unsharded_head():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    head = LogpHead(D, V, mesh=mesh, tp_axis="tp", weight_layout="dv", backend="reference", rngs=nnx.Rngs(0))
    plain = LogpHead(D, V, weight_layout="dv", backend="reference", rngs=nnx.Rngs(0))
    assert head.kernel.shape == (D, 512)
    np.testing.assert_array_equal(np.asarray(head.kernel[...])[:, V:], 0)  # padding columns stay zero
    plain.kernel[...] = head.kernel[...][:, :V]
    h, t = _data()
    assert_bitwise_equal(head(h, t).logp, plain(h, t).logp, "tp dv logp")


def test_residual_mode_as_a_module_option_and_per_call():
    """residuals="logits" on the head (and per call, either way) reaches linear_logp and the
    TP entry: the same forward bytes, and the op's gradient bytes in the chosen mode."""
    h, t = _data()
    head = LogpHead(D, V, use_bias=True, backend="reference", residuals="logits", rngs=nnx.Rngs(0))
    head.bias[...] = jax.random.normal(jax.random.PRNGKey(5), (V,)) * 0.1
    assert head.residuals == "logits" and LogpHead(D, V, rngs=nnx.Rngs(0)).residuals == "recompute"
    kw = dict(bias=head.bias[...], vocab_size=V, padded_vocab_size=512, backend="reference", return_entropy=True)

    def op_grads(mode):
        def f(w, b):
            o = linear_logp(h, w, t, **dict(kw, bias=b), residuals=mode)
            return jnp.sum(o.logp) + 0.3 * jnp.sum(o.entropy)

        return jax.grad(f, argnums=(0, 1))(head.kernel[...], head.bias[...])

    def head_grads(m, **call):
        def f(m):
            o = m(h, t, return_entropy=True, **call)
            return jnp.sum(o.logp) + 0.3 * jnp.sum(o.entropy)

        g = nnx.grad(f)(m)
        return g.weight[...], g.bias[...]

    want = {mode: op_grads(mode) for mode in ("recompute", "logits")}
    # the modes' bytes differ here (the saved and the recomputed logits round apart), so
    # equal bytes below say which mode ran
    assert any((np.asarray(a) != np.asarray(b)).any() for a, b in zip(want["recompute"], want["logits"]))
    plain = LogpHead(D, V, use_bias=True, backend="reference", rngs=nnx.Rngs(0))
    plain.bias[...] = head.bias[...]
    for got, mode in (
        (head_grads(head), "logits"),
        (head_grads(head, residuals="recompute"), "recompute"),
        (head_grads(plain), "recompute"),
        (head_grads(plain, residuals="logits"), "logits"),
    ):
        for a, b in zip(got, want[mode]):
            assert_bitwise_equal(a, b, f"head gradient, {mode}")
    assert_bitwise_equal(head(h, t).logp, plain(h, t).logp, "forward bytes")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    tp = LogpHead(
        D, V, use_bias=True, mesh=mesh, tp_axis="tp", backend="reference", residuals="logits", rngs=nnx.Rngs(0)
    )
    tp.kernel[...] = jnp.pad(head.kernel[...], ((0, 512 - V), (0, 0)))
    tp.bias[...] = jnp.pad(head.bias[...], (0, 512 - V))
    gw, gb = head_grads(tp)
    np.testing.assert_allclose(np.asarray(gw)[:V], np.asarray(want["logits"][0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gb)[:V], np.asarray(want["logits"][1]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="residuals must be"):
        LogpHead(D, V, residuals="saved", rngs=nnx.Rngs(0))


def test_readme_spelling_of_the_flax_head_works_in_a_fresh_process():
    """`import detlogp_jax as dl; dl.flax.LogpHead(...)`, as the README writes it, with nothing
    imported before (documented submodules are lazy attributes of the package)."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = (
        "import detlogp_jax as dl\n"
        "from flax import nnx\n"
        "import jax.numpy as jnp\n"
        "head = dl.flax.LogpHead(32, 300, rngs=nnx.Rngs(0))\n"
        "out = head(jnp.ones((2, 32)), jnp.zeros((2,), jnp.int32))\n"
        "assert dl.sampling.SamplingProgram and dl.__version__\n"
        "print(out.logp.shape, out.provenance.backend)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["(2,)", "reference"], r.stdout + r.stderr[-2000:]
