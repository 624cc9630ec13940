"""JAX-native fit: [D, V] kernels in place, meshes and shard_map, export, and safety rails
that hold under jit caching (strict mode, provenance, explicit backends, target widths),
and the exact temperature gradient."""

import json
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import detlogp_jax as dl
from detlogp_jax import backends
from tests.helpers import assert_bitwise_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, VOCAB, V_ROWS = 64, 600, 640


def _data(n=37, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, D)), dtype)
    w = jnp.asarray(rng.standard_normal((V_ROWS, D)) * 0.2, dtype)
    b = jnp.asarray(rng.standard_normal(V_ROWS) * 0.1, jnp.float32)
    t = rng.integers(0, VOCAB, n).astype(np.int32)
    t[:3] = -100, VOCAB - 1, 0
    temp = jnp.asarray(rng.uniform(0.6, 1.4, n), jnp.float32)
    return h, w, b, jnp.asarray(t), temp


# --- weight layout ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_dv_layout_gives_the_vd_bytes_on_the_reference_backend(dtype):
    h, w, b, t, temp = _data(dtype=dtype)
    k = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
    kw = dict(bias=b, temperature=temp, vocab_size=VOCAB, return_logits=True, backend="reference")
    a = dl.linear_logp(h, w, t, **kw)
    c = dl.linear_logp(h, k, t, weight_layout="dv", **kw)
    for x, y, what in zip(a[:3], c[:3], ("logp", "lse", "logits")):
        assert_bitwise_equal(x, y, what)
    assert c.provenance.weight_layout == "dv" and a.provenance.weight_layout == "vd"
    # provenance() says what a call would get, without computing: the same record
    kw.pop("return_logits"), kw.pop("bias"), kw.pop("temperature")
    assert dl.provenance(h, k, weight_layout="dv", **kw) == c.provenance


def test_dv_layout_with_an_unpadded_kernel_declaring_the_padded_vocab():
    h, w, _, t, _ = _data()
    padded = dl.linear_logp(h, w, t, vocab_size=VOCAB, backend="reference")
    k = jnp.asarray(np.ascontiguousarray(np.asarray(w)[:VOCAB].T))  # [D, 600], declared as 640
    got = dl.linear_logp(h, k, t, vocab_size=VOCAB, padded_vocab_size=V_ROWS, backend="reference", weight_layout="dv")
    assert_bitwise_equal(got.logp, padded.logp, "logp")
    assert_bitwise_equal(got.lse, padded.lse, "lse")


def test_square_weight_follows_the_declared_layout_never_a_guess():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((9, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 64, 9), jnp.int32)
    as_dv = dl.linear_logp(h, w, t, backend="reference", weight_layout="dv")
    transposed = dl.linear_logp(h, w.T, t, backend="reference")
    assert_bitwise_equal(as_dv.logp, transposed.logp, "dv == vd of the transpose")
    assert not np.array_equal(np.asarray(as_dv.logp), np.asarray(dl.linear_logp(h, w, t, backend="reference").logp))


def test_layout_errors_at_trace_time():
    h, w, _, t, _ = _data()
    with pytest.raises(ValueError, match="weight_layout must be"):
        dl.linear_logp(h, w, t, weight_layout="kv")
    with pytest.raises(ValueError, match="pass weight_layout='dv'"):
        dl.linear_logp(h, w.T, t)  # a [D, V] kernel without the layout
    with pytest.raises(ValueError, match="pass weight_layout='vd'"):
        dl.linear_logp(h, w, t, weight_layout="dv")
    with pytest.raises(ValueError, match="bias"):
        dl.linear_logp(h, w.T, t, bias=jnp.zeros(V_ROWS - 1), weight_layout="dv")


def _hlo_ops(compiled_text):
    ops = []
    for line in compiled_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) ([\w-]+)\(", line)
        if m:
            ops.append((m.group(2), m.group(1)))
    return ops


def _jaxpr_transposes(jaxpr, shape):
    """transpose equations anywhere in a jaxpr (sub-jaxprs too) whose operand has `shape`."""
    found = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "transpose" and tuple(eqn.invars[0].aval.shape) == shape:
            found += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    found += _jaxpr_transposes(getattr(inner, "jaxpr", inner), shape)
    return found


@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_dv_kernel_is_never_transposed_or_copied(backend):
    """The [D, V] kernel is read in place: no transpose of it in the jaxpr, no transpose or
    copy of a [D, V]- or [V, D]-shaped array in the compiled HLO, forward or gradient."""
    h, w, b, t, _ = _data()
    k = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))

    def loss(h, k, b):
        return jnp.sum(
            jnp.nan_to_num(dl.linear_logp(h, k, t, bias=b, vocab_size=VOCAB, backend=backend, weight_layout="dv").logp)
        )

    fns = {
        "forward": jax.jit(
            lambda h, k, b: dl.linear_logp(h, k, t, bias=b, vocab_size=VOCAB, backend=backend, weight_layout="dv").logp
        ),
        "gradient": jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
    }
    shapes = {f"[{D},{V_ROWS}]", f"[{V_ROWS},{D}]"}
    for name, fn in fns.items():
        assert _jaxpr_transposes(jax.make_jaxpr(fn)(h, k, b).jaxpr, (D, V_ROWS)) == 0, name
        moved = [
            (op, ty)
            for op, ty in _hlo_ops(fn.lower(h, k, b).compile().as_text())
            if op in ("transpose", "copy") and any(s in ty for s in shapes)
        ]
        assert not moved, (name, moved)
    # the check can fail: a transposed kernel does show up
    bad = jax.jit(lambda h, k, b: dl.linear_logp(h, k.T, t, bias=b, vocab_size=VOCAB, backend=backend).logp)
    assert _jaxpr_transposes(jax.make_jaxpr(bad)(h, k, b).jaxpr, (D, V_ROWS)) == 1


def test_dv_gradients_in_the_callers_layout_match_float64():
    h, w, b, t, temp = _data(n=21)
    k = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))

    def loss(h, k, b):
        o = dl.linear_logp(h, k, t, bias=b, temperature=temp, vocab_size=VOCAB, backend="reference", weight_layout="dv")
        return jnp.sum(jnp.nan_to_num(o.logp) + 0.5 * o.lse)

    dh, dk, db = jax.grad(loss, argnums=(0, 1, 2))(h, k, b)
    assert dk.shape == k.shape
    with jax.enable_x64(True):
        h64, k64, b64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (h, k, b))
        inv_t = 1.0 / jnp.asarray(np.asarray(temp), jnp.float64)

        def f64(h, k, b):
            z = (h @ k + b)[:, :VOCAB] * inv_t[:, None]
            lse = jax.nn.logsumexp(z, axis=1)
            live = (t >= 0) & (t < VOCAB)
            zt = jnp.take_along_axis(z, jnp.clip(t, 0, VOCAB - 1)[:, None], axis=1)[:, 0]
            return jnp.sum(jnp.where(live, zt - lse, 0.0) + 0.5 * lse)

        want = jax.grad(f64, argnums=(0, 1, 2))(h64, k64, b64)
    for g, e, name in zip((dh, dk, db), want, ("hidden", "kernel", "bias")):
        g, e = np.asarray(g, np.float64), np.asarray(e)
        assert np.linalg.norm(g - e) <= 1e-5 * np.linalg.norm(e), name


# --- meshes and shard_map (8 host devices, in a subprocess) ------------------------------


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("mesh") / "mesh.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    # the fast tier computes only its own cases (each test's first; tests/mesh_cases.py)
    env["MESH_CASES"] = "fast" if request.config.getoption("markexpr", "") == "not slow" else "all"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "mesh_cases.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["ok"], data.get("error")
    return data["result"]


MESH_CASES = [
    f"{kind}_{case}"
    for kind in ("explicit", "auto")
    for case in ("jit_grad", "set_mesh_grad", "one_axis_grad", "dv_grad")
]
MESH_CASES += ["shard_map_check_vma_True", "shard_map_check_vma_False"]


@pytest.mark.parametrize("case", MESH_CASES)
def test_sharded_rows_give_single_device_bytes_and_gradients(mesh_results, case):
    r = mesh_results[case]
    assert "error" not in r, r.get("error")
    assert r["logp_rows_differ"] == 0 and r["lse_rows_differ"] == 0, r
    assert r["grad_max_abs_diff"] <= 1e-5 * max(1.0, mesh_results["scale"]), r


@pytest.mark.parametrize("residuals", ["recompute", "logits"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("how", ["eager", "jit"])
def test_gradient_of_replicated_inputs_under_set_mesh_of_explicit_axes(mesh_results, residuals, layout, how):
    """jax.grad under `jax.set_mesh` of an Explicit-axis mesh with plain replicated inputs (the
    entropy in the loss, a per-row temperature): the no-mesh gradient, the single-device bytes."""
    r = mesh_results[f"replicated_set_mesh_{residuals}_{layout}_{how}"]
    assert "error" not in r, r.get("error")
    assert r["logp_rows_differ"] == 0 and r["lse_rows_differ"] == 0, r
    assert r["grad_max_abs_diff"] <= 1e-5 * max(1.0, mesh_results["entropy_scale"]), r


@pytest.mark.parametrize("case", [f"tp{tp}_dv_{w}" for tp in (2, 4, 8) for w in ("global", "shards")])
def test_tp_with_a_dv_kernel_gives_single_device_bytes(mesh_results, case):
    r = mesh_results[case]
    assert "error" not in r, r.get("error")
    assert r["logp_rows_differ"] == 0 and r["lse_rows_differ"] == 0, r


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_sharded_rows_give_single_device_entropy_and_temperature_gradient(mesh_results, kind):
    r = mesh_results[f"{kind}_entropy_temperature_grad"]
    assert "error" not in r, r.get("error")
    assert r["logp_rows_differ"] == 0 and r["lse_rows_differ"] == 0 and r["entropy_rows_differ"] == 0, r
    assert r["grad_max_abs_diff"] <= 1e-5 * max(1.0, mesh_results["entropy_scale"]), r


def test_vocab_sharded_weight_on_an_auto_mesh_is_served_with_the_same_bytes(mesh_results):
    r = mesh_results["auto_sharded_weight"]
    assert "error" not in r, r.get("error")
    assert r["logp_rows_differ"] == 0 and r["lse_rows_differ"] == 0, r


def test_shardings_the_op_cannot_serve_are_refused(mesh_results):
    assert "linear_logp_tp" in mesh_results["sharded_weight_error"], mesh_results["sharded_weight_error"]
    assert "D axis" in mesh_results["sharded_d_error"], mesh_results["sharded_d_error"]


# --- jax.export with symbolic batch dimensions ------------------------------------------


def test_export_with_symbolic_rows_round_trips_bit_for_bit():
    _, w, b, _, _ = _data()
    f = jax.jit(lambda h, t: dl.linear_logp(h, w, t, bias=b, vocab_size=VOCAB, backend="reference")[:2])
    (n,) = export.symbolic_shape("n")
    exp = export.export(f)(jax.ShapeDtypeStruct((n, D), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32))
    restored = export.deserialize(exp.serialize())
    bb, s = export.symbolic_shape("b, s")
    exp2 = export.export(f)(jax.ShapeDtypeStruct((bb, s, D), jnp.float32), jax.ShapeDtypeStruct((bb, s), jnp.int32))
    rng = np.random.default_rng(3)
    for m in (1, 5, 37, 300):
        h = jnp.asarray(rng.standard_normal((m, D)), jnp.float32)
        t = jnp.asarray(rng.integers(0, VOCAB, m), jnp.int32)
        want = f(h, t)
        for got, what in ((exp.call(h, t), "exported"), (restored.call(h, t), "deserialized")):
            assert_bitwise_equal(got[0], want[0], f"{what} logp M={m}")
            assert_bitwise_equal(got[1], want[1], f"{what} lse M={m}")
    h = jnp.asarray(rng.standard_normal((3, 7, D)), jnp.float32)
    t = jnp.asarray(rng.integers(0, VOCAB, (3, 7)), jnp.int32)
    assert_bitwise_equal(exp2.call(h, t)[0], f(h, t)[0], "[b, s] export")


# --- safety rails under jit caching ------------------------------------------------------


def test_strict_mode_context_retraces_a_cached_non_contract_function():
    h, w, _, t, _ = _data()
    f = jax.jit(lambda a: dl.linear_logp(a, w, t, backend="xla"))
    assert f(h).provenance.backend == "xla"
    with dl.strict_mode():
        with pytest.raises(dl.StrictModeError):
            f(h)
    assert f(h).provenance.backend == "xla"  # outside the context again: served


def test_strict_environment_set_after_the_trace_raises_at_the_call():
    code = (
        "import os, numpy as np, jax, detlogp_jax as dl\n"
        "h=np.ones((2,64),np.float32); w=np.ones((128,64),np.float32); t=np.zeros(2,np.int32)\n"
        "f=jax.jit(lambda a: dl.linear_logp(a,w,t,backend='xla').logp)\n"
        "f(h).block_until_ready()\n"
        "os.environ['DETLOGP_STRICT']='1'\n"
        "try:\n    f(h).block_until_ready(); print('served')\n"
        "except Exception as e: print('refused' if 'DETLOGP_STRICT is set' in str(e) else 'other: '+str(e)[:300])\n"
        "g=jax.jit(lambda a: dl.linear_logp(a,w,t,backend='reference').logp)\n"
        "g(h).block_until_ready(); print('contract lane served')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("DETLOGP_STRICT", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["refused", "contract", "lane", "served"], out.stdout + out.stderr[-2000:]


def test_provenance_rides_on_the_output_of_cached_jitted_calls():
    h, w, _, t, _ = _data()
    f = jax.jit(lambda a: dl.linear_logp(a, w, t, backend="xla"))
    g = jax.jit(lambda a: dl.linear_logp(a, w, t, backend="reference"))
    f(h)
    g(h)  # traced last: last_provenance() names it
    assert dl.last_provenance().backend == "reference"
    out = f(h)  # cached: runs no Python, but its output carries its own record
    assert out.provenance.backend == "xla" and not out.provenance.contract_bearing
    assert dl.last_provenance().backend == "reference"  # documented: last call that ran Python


def test_explicit_unavailable_backend_raises_and_only_auto_chooses(monkeypatch):
    h, w, _, t, _ = _data()
    if backends.get("pallas_sm90").available():
        pytest.skip("a Hopper GPU is present")
    with pytest.raises(dl.BackendUnavailableError, match="not available on this machine"):
        dl.linear_logp(h, w, t, backend="pallas_sm90")
    with pytest.raises(dl.BackendUnavailableError):
        jax.jit(lambda a: dl.linear_logp(a, w, t, backend="pallas_sm90").logp)(h)
    monkeypatch.setenv("DETLOGP_BACKEND", "pallas_sm90")  # a request too: no fallback
    with pytest.raises(dl.BackendUnavailableError):
        dl.linear_logp(h, w, t)
    monkeypatch.delenv("DETLOGP_BACKEND")
    monkeypatch.setattr(backends, "preferred", lambda: "pallas_sm90")  # auto's choice cannot run: it falls back
    with pytest.warns(UserWarning, match="auto falls back"):
        out = dl.linear_logp(h, w, t, backend="auto")
    assert out.provenance.fallback and out.provenance.backend == "reference"
    with dl.strict_mode(), pytest.raises(dl.StrictModeError):
        dl.linear_logp(h, w, t, backend="auto")


def test_backend_refusing_a_layout_raises_for_an_explicit_request(monkeypatch):
    h, w, _, t, _ = _data()
    ref = backends.get("reference")
    monkeypatch.setitem(backends._LOADED, "reference", type(ref)(**{**ref.__dict__, "layouts": frozenset({"vd"})}))
    with pytest.raises(dl.BackendUnavailableError, match="weight_layout='dv'"):
        dl.linear_logp(h, w.T, t, backend="reference", weight_layout="dv")


INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"]


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_targets_of_any_width_are_range_checked_before_narrowing(dtype, x64):
    """Values outside [0, vocab) other than -100 are bad targets (NaN in their row only),
    whatever the width: an int64 2**32 + 5 is not token 5, a uint32 4294967196 is not -100."""
    rng = np.random.default_rng(5)
    vocab = 100  # fits every width
    h = jnp.asarray(rng.standard_normal((8, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((128, D)) * 0.2, jnp.float32)
    info = np.iinfo(dtype)
    vals = [5, vocab - 1, vocab, info.max, 0]
    want_bad = [False, False, True, True, False]
    if info.min < 0:
        vals += [-100, -1, info.min]
        want_bad += [False, True, True]
    if dtype in ("int64", "uint32"):
        vals += [2**32 + 5 if dtype == "int64" else 4294967196]
        want_bad += [True]
    t_np = np.asarray(vals, dtype)
    h = h[: len(vals)] if len(vals) <= 8 else jnp.tile(h, (2, 1))[: len(vals)]
    ref = dl.linear_logp(
        h,
        w,
        jnp.asarray(np.where(np.asarray(want_bad), 7, np.asarray(vals, np.int64)).astype(np.int32)),
        vocab_size=vocab,
        backend="reference",
    ).logp
    with jax.enable_x64(x64):
        for t in (t_np, jnp.asarray(t_np) if (x64 or info.bits <= 32) else None):
            if t is None:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = np.asarray(dl.linear_logp(h, w, t, vocab_size=vocab, backend="reference").logp)
            assert np.array_equal(np.isnan(got), np.asarray(want_bad)), (dtype, x64, vals, got)
            ok = ~np.asarray(want_bad)
            assert_bitwise_equal(got[ok], np.asarray(ref)[ok], f"{dtype} good rows")
            with pytest.raises(ValueError, match="outside"):
                dl.linear_logp(h, w, t, vocab_size=vocab, backend="reference", checked=True)


def _f64_temperature_loss(h, w, b, t, vocab, c_lp, c_lse, c_h):
    """float64 sum(c_lp * logp + c_lse * lse + c_h * entropy) as a function of T (materialized)."""

    def f(temp):
        z = (jnp.asarray(np.asarray(h), jnp.float64) @ jnp.asarray(np.asarray(w), jnp.float64).T)[:, :vocab]
        z = z + jnp.asarray(np.asarray(b), jnp.float64)[:vocab]
        y = z / jnp.broadcast_to(temp, t.shape)[:, None]
        lse = jax.nn.logsumexp(y, axis=1)
        ent = lse - jnp.sum(jax.nn.softmax(y, axis=1) * y, axis=1)
        live = (t >= 0) & (t < vocab)
        yt = jnp.take_along_axis(y, jnp.clip(t, 0, vocab - 1)[:, None], axis=1)[:, 0]
        return jnp.sum(jnp.where(live, yt - lse, 0.0) * c_lp + lse * c_lse + ent * c_h)

    return f


@pytest.mark.parametrize("per_row", [False, True])
def test_the_temperature_gradient_is_exact(per_row):
    """d/dT of logp, lse and the entropy (scalar or per-row T) equal float64 autodiff of the
    materialized math: fl(1/T) is integer code, its derivative -1/T^2 is attached around it and
    the op's custom VJP returns the exact inv_t cotangent (E_p[y], Var_p(y) per row)."""
    h, w, b, t, temp = _data(n=21)
    temp = temp if per_row else jnp.asarray(1.3, jnp.float32)
    for c_lp, c_lse, c_h in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.7, -0.4, 1.9)):

        def loss(temp):
            o = dl.linear_logp(
                h, w, t, bias=b, temperature=temp, vocab_size=VOCAB, backend="reference", return_entropy=c_h != 0
            )
            out = jnp.sum(jnp.nan_to_num(o.logp) * c_lp) + jnp.sum(o.lse * c_lse)
            return out + (jnp.sum(o.entropy * c_h) if c_h else 0.0)

        got = np.asarray(jax.grad(loss)(temp), np.float64)
        with jax.enable_x64(True):
            want = np.asarray(
                jax.grad(_f64_temperature_loss(h, w, b, t, VOCAB, c_lp, c_lse, c_h))(
                    jnp.asarray(np.asarray(temp), jnp.float64)
                )
            )
        assert got.shape == want.shape
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), (c_lp, c_lse, c_h, got, want)
    # stop_gradient still gives a zero temperature gradient, and the other gradients are unchanged
    g = jax.grad(
        lambda T: dl.linear_logp(h, w, t, temperature=jax.lax.stop_gradient(T), backend="reference").logp.sum()
    )(1.3)
    assert float(g) == 0.0
