"""detlogp_jax.integrations.tunix on tiny random Tunix models (CPU, float32).

Skipped when google-tunix is not importable; `bash scripts/test_tunix.sh` runs this file in a
venv of requirements/cpu.lock + requirements/tunix.lock.
"""

import dataclasses
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed (requirements/tunix.lock; scripts/test_tunix.sh)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.generate import sampler as sampler_lib  # noqa: E402
from tunix.rl import algo_core, common  # noqa: E402

from detlogp_jax import fingerprint as fp_lib  # noqa: E402
from detlogp_jax.integrations import tunix as dt  # noqa: E402
from tests.helpers import ROOT, assert_bitwise_equal  # noqa: E402
from tests.tunix_models import EOS, PAD, V, WordTokenizer, batch, make_model  # noqa: E402

TOL = 2e-5


@pytest.fixture(autouse=True)
def _unpatched():
    dt.unpatch()
    yield
    dt.unpatch()


def tunix_logps(model, prompt, comp, **kw):
    gd, st = nnx.split(model)
    return common.compute_per_token_logps(gd, st, jnp.asarray(prompt), jnp.asarray(comp), PAD, EOS, **kw)


MODELS = [("qwen3", False), ("qwen3", True), ("llama3", False), ("llama3", True)]


@pytest.mark.parametrize("kind,tied", MODELS, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in MODELS])
def test_per_token_logps_matches_tunix(kind, tied):
    model = make_model(kind, tied)
    prompt, comp = batch(seed=1)
    mask = comp != PAD
    weight, layout = dt.head_weight(model)
    assert layout == ("vd" if tied else "dv")
    assert weight is (model.embedder.input_embedding if tied else model.lm_head.w)[...]  # the Param's array
    for temperature in (1.0, 0.7):
        got = dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS, temperature=temperature)
        ref = tunix_logps(model, prompt, comp, temperature=temperature)
        assert got.shape == ref.shape == comp.shape and got.dtype == jnp.float32
        diff = np.abs(np.asarray(got) - np.asarray(ref))[mask]
        assert diff.max() < TOL, (temperature, diff.max())


def test_gemma3_and_qwen2_match_tunix():
    prompt, comp = batch(seed=2)
    mask = comp != PAD
    for model in (make_model("gemma3", True), make_model("qwen2", False), make_model("qwen2", True)):
        got = dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS, temperature=0.7)
        ref = tunix_logps(model, prompt, comp, temperature=0.7)
        assert np.abs(np.asarray(got) - np.asarray(ref))[mask].max() < TOL, type(model).__name__


def test_packed_sequences_match_tunix():
    model = make_model("qwen3", False)
    rng = np.random.default_rng(5)
    buf = rng.integers(3, V, (2, 9)).astype(np.int32)
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 2, 2, 2, 3, 3, 3, 0]], np.int32)
    pos = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 0, 1, 2, 0]], np.int32)
    empty = np.zeros((2, 0), np.int32)
    kw = dict(segment_ids=jnp.asarray(seg), segment_positions=jnp.asarray(pos), temperature=0.7)
    got = dt.per_token_logps(model, empty, buf, pad_id=PAD, eos_id=EOS, **kw)
    ref = tunix_logps(model, empty, buf, **kw)
    assert got.shape == ref.shape == buf.shape
    assert float(got[0, 0]) == 0.0 and float(got[1, 0]) == 0.0  # Tunix's front padding
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() < TOL


def test_return_logits_match_tunix():
    model = make_model("qwen3", True)
    prompt, comp = batch(seed=4)
    lp, logits = dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS, temperature=0.7, return_logits=True)
    ref_lp, ref_logits = tunix_logps(model, prompt, comp, temperature=0.7, return_logits=True)
    assert logits.shape == ref_logits.shape == comp.shape + (V,)
    assert np.abs(np.asarray(logits) - np.asarray(ref_logits)).max() < TOL
    assert np.abs(np.asarray(lp) - np.asarray(ref_lp))[comp != PAD].max() < TOL


@pytest.mark.parametrize("residuals", ["recompute", "logits"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gradients_match_tunix(tied, residuals):
    model = make_model("qwen3", tied)
    prompt, comp = batch(seed=6)
    mask = jnp.asarray(comp != PAD, jnp.float32)
    gd, st = nnx.split(model)

    def ours(st):
        lp = dt.per_token_logps(
            nnx.merge(gd, st), prompt, comp, pad_id=PAD, eos_id=EOS, temperature=0.7, residuals=residuals
        )
        return jnp.sum(lp * mask)

    def theirs(st):
        lp = common.compute_per_token_logps(
            gd, st, jnp.asarray(prompt), jnp.asarray(comp), PAD, EOS, stop_gradient=False, temperature=0.7
        )
        return jnp.sum(lp * mask)

    g1, g2 = jax.grad(ours)(st), jax.grad(theirs)(st)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-6
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-4 * max(scale, 1.0), jax.tree_util.keystr(path)


def _float_shapes(jaxpr, out):
    """Every float var shape in a jaxpr and all its sub-jaxprs (pjit, custom_vjp, while, cond, shard_map, ...)."""

    def visit_var(v):
        aval = getattr(v, "aval", None)
        if (
            aval is not None
            and hasattr(aval, "shape")
            and jnp.issubdtype(getattr(aval, "dtype", np.int32), jnp.floating)
        ):
            out.append(tuple(aval.shape))

    def sub(x):
        if isinstance(x, jax.extend.core.ClosedJaxpr):
            _float_shapes(x.jaxpr, out)
        elif isinstance(x, jax.extend.core.Jaxpr):
            _float_shapes(x, out)
        elif isinstance(x, (tuple, list)):
            for y in x:
                sub(y)

    for v in list(jaxpr.invars) + list(jaxpr.constvars):
        visit_var(v)
    for eqn in jaxpr.eqns:
        for v in list(eqn.invars) + list(eqn.outvars):
            visit_var(v)
        for p in eqn.params.values():
            sub(p)
    return out


def _eqns_on(jaxpr, shape, prims, out):
    """Names of the equations among `prims` that read an operand of `shape` (sub-jaxprs included)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in prims and any(tuple(getattr(v.aval, "shape", ())) == shape for v in eqn.invars):
            out.append(eqn.primitive.name)
        for p in eqn.params.values():
            for x in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(x, jax.extend.core.ClosedJaxpr):
                    _eqns_on(x.jaxpr, shape, prims, out)
                elif isinstance(x, jax.extend.core.Jaxpr):
                    _eqns_on(x, shape, prims, out)
    return out


def _has_blv(shapes, b, lengths, v):
    """A float array holding one vocab row per token: [b, l, v] or [b * l, v] for a sequence length l
    (v, or v rounded up to the op's 64-column tiles)."""
    rows = {b * n for n in lengths}
    vs = {v, -(-v // 64) * 64}
    for s in shapes:
        hit = [x for x in s if x in vs]
        if hit:
            rest = list(s)
            rest.remove(hit[0])
            n = int(np.prod(rest)) if rest else 1
            if n in rows and (len(rest) == 1 or (len(rest) == 2 and rest[0] == b)):
                return s
    return None


BIG_V = 40_000  # > TARGET_SPLITS * 64 columns: one step of the op's vocab walk is a chunk, not all of V


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_no_BLV_intermediate(tied):
    model = make_model("qwen3", tied, vocab=BIG_V)
    prompt, comp = batch(seed=1)
    b, p = prompt.shape
    c = comp.shape[1]
    gd, st = nnx.split(model)
    lengths = (p + c, c, p + c - 1)
    d = model.config.embed_dim
    assert d not in {b * n for n in lengths}  # so the weight [V, D] / [D, V] is not mistaken for one

    ours = jax.make_jaxpr(lambda st: dt.per_token_logps(nnx.merge(gd, st), prompt, comp, pad_id=PAD, eos_id=EOS))(st)
    shapes = _float_shapes(ours.jaxpr, [])
    assert _has_blv(shapes, b, lengths, BIG_V) is None, _has_blv(shapes, b, lengths, BIG_V)
    # the weight is read in place: no transposed or cast copy of it anywhere
    w_shape = (BIG_V, d) if tied else (d, BIG_V)
    copies = _eqns_on(ours.jaxpr, w_shape, ("transpose", "convert_element_type", "copy", "copy_p"), [])
    assert not copies, f"the weight {w_shape} is copied: {copies}"
    # positive control: Tunix's own path has the [B, L, V] logits
    theirs = jax.make_jaxpr(lambda st: common.compute_per_token_logps(gd, st, prompt, comp, PAD, EOS))(st)
    assert _has_blv(_float_shapes(theirs.jaxpr, []), b, lengths, BIG_V) is not None


def test_return_entropy_passes_through_or_refuses():
    model = make_model("qwen3", False)
    prompt, comp = batch(seed=1)
    if "return_entropy" in inspect.signature(dt.api.linear_logp).parameters:
        lp, ent = dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS, return_entropy=True)
        assert ent.shape == lp.shape == comp.shape
    else:
        with pytest.raises(NotImplementedError, match="return_entropy"):
            dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS, return_entropy=True)
        with pytest.raises(NotImplementedError, match="return_entropy"):
            dt.patch(entropy="op")
        assert not dt.is_patched()


def test_unknown_and_softcapped_models_refused():
    class Plain(nnx.Module):
        def __init__(self):
            self.lm_head = nnx.Linear(4, 8, rngs=nnx.Rngs(0))

    with pytest.raises(dt.UnsupportedModelError, match="does not know the model class .*Plain.*known classes"):
        dt.per_token_logps(Plain(), np.zeros((1, 2), np.int32), np.ones((1, 2), np.int32), pad_id=0, eos_id=2)

    class Capped(nnx.Module):
        def __init__(self):
            self.config = type("Cfg", (), {"final_logit_softcap": 30.0})()

    with pytest.raises(dt.UnsupportedModelError, match="soft-capping"):
        dt.head_weight(Capped())


# --- the sampler side ---------------------------------------------------------------------


def _sampler(model):
    cfg = model.config
    return sampler_lib.Sampler(
        model,
        WordTokenizer(),
        sampler_lib.CacheConfig(
            cache_size=24, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
        ),
    )


PROMPTS = ["w5 w6 w7", "w9 w10", "w11 w12 w13 w14"]


@pytest.mark.parametrize("kind,tied", [("qwen3", False), ("llama3", True)], ids=["qwen3-untied", "llama3-tied"])
def test_rollout_then_trainer_scoring(kind, tied, monkeypatch, record_property):
    """The patched sampler records the op's logp of each sampled token; the trainer's per_token_logps on
    the same hidden states gives the same bytes; end to end (KV-cache decode vs full forward) the
    difference is the model body's."""
    model = make_model(kind, tied)
    s = _sampler(model)
    seen = []  # (hidden [B, D], tokens [B], logp [B]) of every sampler step, in program order
    real = dt.token_logps

    def spy(m, hidden, tokens, **kw):
        lp = real(m, hidden, tokens, **kw)
        jax.debug.callback(
            lambda h, t, x: seen.append((np.asarray(h), np.asarray(t), np.asarray(x))), hidden, tokens, lp, ordered=True
        )
        return lp

    monkeypatch.setattr(dt, "token_logps", spy)
    temperature, steps = 0.7, 5
    with dt.patch():
        out = s(
            PROMPTS,
            max_generation_steps=steps,
            max_prompt_length=4,
            temperature=temperature,
            top_p=1.0,
            seed=7,
            return_logprobs=True,
        )
    record = dt.rollout_record(s)
    assert record is not None and record.layout == ("vd" if tied else "dv") and record.temperature == temperature
    # one op call per sampled token: the prefill's, then one per decode step (the loop may run one
    # step past the buffer, whose token is dropped, or stop early when every row hit EOS)
    assert len(seen) >= max(len(t) for t in out.tokens)
    seen = seen[:steps]
    h_roll = np.stack([x[0] for x in seen], 1)  # [B, steps, D]
    tok = np.stack([x[1] for x in seen], 1)
    lp_roll = np.stack([x[2] for x in seen], 1)
    steps = tok.shape[1]

    # what the sampler returned is what the op computed; compare up to EOS (and up to a sampled pad
    # id, after which the trainer's pad mask and positions differ from the sampler's by design)
    lengths = [int(np.argmax(np.r_[t, PAD] == PAD)) for t in out.tokens]
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(tok[i, :n], out.tokens[i][:n])
        assert_bitwise_equal(np.asarray(out.logprobs[i][:n], np.float32), lp_roll[i, :n], "recorded logprobs")

    # trainer side, same weight version
    dt.check_weight_version(model, record)
    prompt = np.asarray(out.padded_prompt_tokens, np.int32)
    comp = np.full((len(PROMPTS), steps), PAD, np.int32)
    for i, n in enumerate(lengths):
        comp[i, :n] = out.tokens[i][:n]
    train = np.asarray(dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS, temperature=temperature))

    # operator level: the trainer's batched op on the sampler's hidden states -> the recorded bytes
    op_batched = np.asarray(real(model, jnp.asarray(h_roll), jnp.asarray(tok), temperature=temperature))
    for i, n in enumerate(lengths):
        assert_bitwise_equal(op_batched[i, :n], lp_roll[i, :n], "op on the rollout's hidden states")
    # and the trainer's hidden states through the sampler's per-step call give the trainer's bytes
    h_train, _ = dt.hidden_states(
        model,
        jnp.concatenate([prompt, comp], 1),
        **_positions_and_mask(prompt, comp),
    )
    h_train = np.asarray(h_train)[:, prompt.shape[1] - 1 : -1]
    per_step = np.stack(
        [
            np.asarray(real(model, jnp.asarray(h_train[:, j]), jnp.asarray(comp[:, j]), temperature=temperature))
            for j in range(steps)
        ],
        1,
    )
    assert_bitwise_equal(per_step, train, "per-step op on the trainer's hidden states")

    # end to end: the model body (cached decode vs full forward) is all that differs
    e2e = max(float(np.max(np.abs(train[i, :n] - lp_roll[i, :n]))) for i, n in enumerate(lengths) if n)
    hid = max(float(np.max(np.abs(h_train[i, :n] - h_roll[i, :n]))) for i, n in enumerate(lengths) if n)
    record_property("end_to_end_max_abs_logp_diff", e2e)
    record_property("hidden_state_max_abs_diff", hid)
    print(f"{kind} tied={tied}: rollout vs trainer logp max|diff| = {e2e:.3g} (hidden states max|diff| = {hid:.3g})")
    assert e2e < 1e-4

    # a weight update is caught before comparing
    st = nnx.state(model, nnx.Param)
    bumped = jax.tree.map(lambda x: x + 1e-3, st)
    other = make_model(kind, tied)
    nnx.update(other, bumped)
    with pytest.raises(fp_lib.FingerprintMismatchError):
        dt.check_weight_version(other, record)


def _positions_and_mask(prompt, comp):
    _, positions, mask, seg = common.process_ids(jnp.asarray(prompt), jnp.asarray(comp), PAD, EOS)
    return dict(positions=positions, cache=None, attention_mask=mask)


def test_greedy_rollout_and_unpatched_sampler_agree():
    """Greedy: the patched sampler picks Tunix's tokens and records log_softmax(z) of them as Tunix does."""
    model = make_model("qwen3", True)
    s = _sampler(model)
    kw = dict(max_generation_steps=4, max_prompt_length=4, temperature=0.0, return_logprobs=True)
    ref = s(PROMPTS, **kw)
    with dt.patch():
        got = s(PROMPTS, **kw)
    assert dt.rollout_record(s).sampling_mode == "greedy" and dt.rollout_record(s).temperature == 1.0
    for a, b, la, lb in zip(ref.tokens, got.tokens, ref.logprobs, got.logprobs):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=TOL)
    after = s(PROMPTS, **kw)  # Tunix's own compiled steps again
    for a, b in zip(ref.logprobs, after.logprobs):
        assert a == b


def test_sampler_refuses_what_the_op_cannot_score():
    s = _sampler(make_model("qwen3", False))
    with dt.patch():
        with pytest.raises(NotImplementedError, match="forbidden_tokens"):
            s(PROMPTS, max_generation_steps=2, max_prompt_length=4, return_logprobs=True, forbidden_tokens=[3])
        with pytest.raises(NotImplementedError, match="beam search"):
            s(PROMPTS, max_generation_steps=2, max_prompt_length=4, beam_size=2)


# --- patch() ------------------------------------------------------------------------------


def test_patch_unpatch_restores_the_function_objects():
    originals = (common.compute_per_token_logps, algo_core.compute_entropy_from_logits)
    cls_attrs = dict(vars(sampler_lib.Sampler))
    h = dt.patch()
    assert dt.is_patched() and h.owner
    assert common.compute_per_token_logps is not originals[0]
    assert common.compute_per_token_logps.__detlogp_original__ is originals[0]
    assert isinstance(vars(sampler_lib.Sampler)["_compiled_prefill_fn"], dt._CompiledRoute)
    again = dt.patch()  # idempotent
    assert not again.owner and dt.is_patched()
    patched_fn = common.compute_per_token_logps
    with again:
        pass
    assert dt.is_patched() and common.compute_per_token_logps is patched_fn  # a non-owner handle leaves it
    with pytest.raises(RuntimeError, match="already patched"):
        dt.patch(backend="xla")
    assert dt.unpatch() is True
    assert (common.compute_per_token_logps, algo_core.compute_entropy_from_logits) == originals
    assert common.compute_per_token_logps is originals[0]
    assert dict(vars(sampler_lib.Sampler)) == cls_attrs
    assert dt.unpatch() is False
    with dt.patch() as h2:
        assert h2.owner and dt.is_patched()
    assert not dt.is_patched() and common.compute_per_token_logps is originals[0]


def test_patch_refuses_unknown_tunix(monkeypatch):
    monkeypatch.setattr(dt, "tunix_version", lambda: "0.0.1")
    with pytest.raises(dt.TunixVersionError, match="0.0.1 is not a version"):
        dt.patch()
    assert not dt.is_patched()
    dt.patch(allow_unverified_version=True)  # signatures still checked, and they match
    dt.unpatch()
    monkeypatch.undo()

    def process_ids(prompt_tokens, completion_tokens, pad_id):  # a changed signature
        raise AssertionError

    monkeypatch.setattr(common, "process_ids", process_ids)
    with pytest.raises(dt.TunixVersionError, match="process_ids"):
        dt.patch()
    assert not dt.is_patched()


def test_patched_compute_per_token_logps_is_a_drop_in():
    model = make_model("llama3", False)
    prompt, comp = batch(seed=8)
    ref = tunix_logps(model, prompt, comp, temperature=0.7)
    with dt.patch():
        got = tunix_logps(model, prompt, comp, temperature=0.7)
        got_lp, got_logits = tunix_logps(model, prompt, comp, temperature=0.7, return_logits=True)
    assert np.abs(np.asarray(got) - np.asarray(ref))[comp != PAD].max() < TOL
    assert got_logits.shape == comp.shape + (V,)
    assert_bitwise_equal(got_lp, got, "return_logits does not change the logp bytes")


def test_grpo_steps_under_patch(monkeypatch):
    """A few GRPO steps of a tiny Qwen3 with Tunix's RLCluster + GRPOLearner (vanilla rollout with
    logprobs, reference model, KL) under patch(): every logprob goes through the op and the loss moves."""
    import optax
    from jax.interpreters import pxla
    from tunix.rl import rl_cluster as rl_lib
    from tunix.rl.grpo import grpo_learner as grpo_lib
    from tunix.rl.rollout import base_rollout

    calls = {"trainer": 0, "sampler": 0}
    real_ptl, real_logits = dt.per_token_logps, dt.head_logits

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1  # at trace time
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(dt, "per_token_logps", count("trainer", real_ptl))
    monkeypatch.setattr(dt, "head_logits", count("sampler", real_logits))

    actor, ref = make_model("qwen3", False, layers=1), make_model("qwen3", False, layers=1)
    before = jax.tree.map(jnp.copy, nnx.state(actor, nnx.Param))
    mesh = pxla.thread_resources.env.physical_mesh
    cc = rl_lib.ClusterConfig(
        role_to_mesh={rl_lib.Role.ACTOR: mesh, rl_lib.Role.REFERENCE: mesh, rl_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_lib.RLTrainingConfig(actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=3),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=4, max_prompt_length=4, kv_cache_size=16, temperature=0.8, return_logprobs=True
        ),
    )

    def reward(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    with dt.patch():
        cluster = rl_lib.RLCluster(actor=actor, reference=ref, tokenizer=WordTokenizer(), cluster_config=cc)
        learner = grpo_lib.GRPOLearner(
            rl_cluster=cluster,
            algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04),
            reward_fns=reward,
        )
        learner.train([{"prompts": np.array(["w5 w6", "w7 w8 w9"])} for _ in range(3)])
    losses = np.asarray(cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train"))
    assert len(losses) == 3 and np.all(np.isfinite(losses)) and len(set(losses.tolist())) > 1, losses
    after = nnx.state(cluster.actor_trainer.model, nnx.Param)
    moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), before, after)))
    assert moved > 0
    assert calls["trainer"] >= 2 and calls["sampler"] >= 2, calls  # loss + reference logps; prefill + decode


def test_tensor_parallel_head_goes_through_linear_logp_tp(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "tunix_tp_cases.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    for case, layout, spec in (("untied", "dv", "P('fsdp', 'tp')"), ("tied", "vd", "P('tp', 'fsdp')")):
        got = res[case]
        assert got["layout"] == layout and got["weight_sharding"] == spec
        assert got["routed"] == [["tp", layout]], got  # linear_logp_tp, weight_layout passed through
        assert got["routed_set_mesh"] == [["tp", layout]] and got["set_mesh_bits_equal"], got
        assert got["op_bits_equal_unsharded"], got
        assert got["max_diff_vs_tunix"] < TOL, got


def test_options_are_hashable_and_checked():
    o = dt.OpOptions(row_axes=("dp",))
    assert hash(o) == hash(dataclasses.replace(o))
    with pytest.raises(TypeError, match="unknown op option"):
        dt.token_logps(make_model("qwen3", True), jnp.zeros((1, 32)), jnp.zeros((1,), jnp.int32), bogus=1)


def test_ppo_loss_using_the_entropy_under_entropy_none_gives_nan_gradients():
    """Tunix's own PPO policy loss with entropy_coef != 0 under patch(entropy="none"): the entropy
    was not computed, so the loss is NaN and its gradients are NaN too (never finite gradients
    without the entropy term); with entropy_coef = 0 the gradients stay finite."""
    from tunix.rl import algo_core
    from tunix.rl.ppo import ppo_learner

    model = make_model("qwen3", False, vocab=BIG_V, layers=1)
    prompt, comp = batch(seed=9)
    example = common.TrainExample(
        prompt_ids=jnp.asarray(prompt),
        prompt_mask=jnp.asarray(prompt != PAD),
        completion_ids=jnp.asarray(comp),
        completion_mask=jnp.asarray(comp != PAD, jnp.int32),
        advantages=jnp.asarray(np.linspace(-1, 1, comp.size).reshape(comp.shape), jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=jnp.full(comp.shape, -5.0, jnp.float32),
    )
    gd, st = nnx.split(model)
    leaves = {}
    for coef in (0.01, 0.0):
        cfg = ppo_learner.PPOConfig(entropy_coef=coef)

        def step(st, cfg=cfg):
            return jax.value_and_grad(
                lambda st: algo_core.ppo_policy_loss_fn(nnx.merge(gd, st), example, cfg, PAD, EOS), has_aux=True
            )(st)

        with dt.patch(entropy="none"):
            (loss, _), grads = jax.jit(step)(st)
        leaves[coef] = (float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)])
    loss, grads = leaves[0.01]
    assert np.isnan(loss)
    assert any(np.isnan(g).any() for g in grads)  # the optimizer cannot step on silently
    loss0, grads0 = leaves[0.0]
    assert np.isfinite(loss0) and all(np.isfinite(g).all() for g in grads0)


def test_grpo_loss_without_BLV_under_entropy_none():
    """Tunix's GRPO loss always asks for the logits (its entropy metric): under the default patch the
    op's [B, C, V] logits are the one such array left; with entropy="none" there is none, the loss
    and its gradient are unchanged and only the entropy metric reads NaN."""
    from tunix.rl import function_registry
    from tunix.rl.grpo import grpo_learner as grpo_lib

    model = make_model("qwen3", False, vocab=BIG_V, layers=1)
    prompt, comp = batch(seed=9)
    b, p = prompt.shape
    c = comp.shape[1]
    example = common.TrainExample(
        prompt_ids=jnp.asarray(prompt),
        prompt_mask=jnp.asarray(prompt != PAD),
        completion_ids=jnp.asarray(comp),
        completion_mask=jnp.asarray(comp != PAD, jnp.int32),
        advantages=jnp.asarray([0.5, -0.25, 1.0], jnp.float32),
        ref_per_token_logps=jnp.full(comp.shape, -5.0, jnp.float32),
        old_per_token_logps=jnp.full(comp.shape, -5.0, jnp.float32),
    )
    cfg = grpo_lib.GRPOConfig(num_generations=3, beta=0.04)
    cfg.temperature = 0.7
    loss_fn = function_registry.get_policy_loss_fn("grpo")
    gd, st = nnx.split(model)

    found = {}
    for mode, residuals in (("logits", "recompute"), ("none", "recompute"), ("none", "logits")):
        # a new function per mode: a traced (jit/make_jaxpr-cached) caller keeps the path it was traced with
        def step(st):
            return jax.value_and_grad(lambda st: loss_fn(nnx.merge(gd, st), example, cfg, PAD, EOS), has_aux=True)(st)

        with dt.patch(entropy=mode, residuals=residuals):
            jaxpr = jax.make_jaxpr(step)(st)
            (loss, aux), grads = jax.jit(step)(st)
        blv = _has_blv(_float_shapes(jaxpr.jaxpr, []), b, (p + c, c, p + c - 1), BIG_V)
        found[mode if residuals == "recompute" else "kept"] = (blv, loss, aux, grads)
    assert found["logits"][0] is not None  # the op's logits handed to Tunix's entropy metric
    assert found["none"][0] is None, found["none"][0]
    # residuals="logits": the op's forward keeps its FP32 logits for the backward (three GEMM passes)
    assert found["kept"][0] is not None
    assert_bitwise_equal(found["none"][1], found["logits"][1], "loss")
    assert_bitwise_equal(found["kept"][1], found["none"][1], "loss with the logits kept")
    assert np.isnan(float(found["none"][2]["entropy"])) and np.isfinite(float(found["logits"][2]["entropy"]))
    for key in ("none", "kept"):
        for a, g in zip(jax.tree.leaves(found[key][3]), jax.tree.leaves(found["logits"][3])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(g), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="residuals"):
        dt.patch(residuals="sometimes")
