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
from tunix.models.qwen3 import model as tunix_qwen3  # noqa: E402
from tunix.rl import algo_core, common  # noqa: E402

import detlogp_jax  # noqa: E402
from detlogp_jax import fingerprint as fp_lib  # noqa: E402
from detlogp_jax.body import backends as body_backends  # noqa: E402
from detlogp_jax.integrations import tunix as dt  # noqa: E402
from tests.helpers import ROOT, assert_bitwise_equal, row_mismatches  # noqa: E402
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


@pytest.mark.slow
def test_gemma3_and_qwen2_match_tunix():
    prompt, comp = batch(seed=2)
    mask = comp != PAD
    for model in (make_model("gemma3", True), make_model("qwen2", False), make_model("qwen2", True)):
        got = dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS, temperature=0.7)
        ref = tunix_logps(model, prompt, comp, temperature=0.7)
        assert np.abs(np.asarray(got) - np.asarray(ref))[mask].max() < TOL, type(model).__name__


@pytest.mark.slow
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


@pytest.mark.slow
def test_return_logits_match_tunix():
    model = make_model("qwen3", True)
    prompt, comp = batch(seed=4)
    lp, logits = dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS, temperature=0.7, return_logits=True)
    ref_lp, ref_logits = tunix_logps(model, prompt, comp, temperature=0.7, return_logits=True)
    assert logits.shape == ref_logits.shape == comp.shape + (V,)
    assert np.abs(np.asarray(logits) - np.asarray(ref_logits)).max() < TOL
    assert np.abs(np.asarray(lp) - np.asarray(ref_lp))[comp != PAD].max() < TOL


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def _sampler(model, cache_size=24):
    cfg = model.config
    return sampler_lib.Sampler(
        model,
        WordTokenizer(),
        sampler_lib.CacheConfig(
            cache_size=cache_size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
        ),
    )


PROMPTS = ["w5 w6 w7", "w9 w10", "w11 w12 w13 w14"]


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("body", [None, "batch_invariant"], ids=["tunix-body", "invariant-body"])
def test_grpo_steps_under_patch(monkeypatch, body):
    """A few GRPO steps of a tiny Qwen3 with Tunix's RLCluster + GRPOLearner (vanilla rollout with
    logprobs, reference model, KL) under patch(): every logprob goes through the op and the loss moves
    (with body="batch_invariant" too: rollout, reference / old logps and the differentiated loss)."""
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

    with dt.patch(body=body):
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- the batch-invariant body (patch(body="batch_invariant")) -------------------------------

BODY_PROMPTS = ["w5 w6 w7", "w9 w10", "w11 w12 w13 w14 w15", "w20"]  # with BOS: 4, 3, 6, 2 tokens
BODY_STEPS, BODY_T = 6, 0.7
BODY_CACHE = 72  # > 64 slots: the sampler's cache spans two of body.attention's KV blocks, the trainer's one


def _body_rollout(model, seed=3, sampler=None):
    """Tunix's vanilla Sampler (patched), a batch of 4 prompts of different lengths left-padded to 8:
    (prompts, completions, recorded logprobs), each cut at EOS (Tunix's own cut) and at a sampled pad id
    (after which Tunix's sampler and trainer positions differ by design)."""
    s = _sampler(model, BODY_CACHE) if sampler is None else sampler
    out = s(
        BODY_PROMPTS,
        max_generation_steps=BODY_STEPS,
        max_prompt_length=8,
        temperature=BODY_T,
        top_p=1.0,
        seed=seed,
        return_logprobs=True,
    )
    lengths = [int(np.argmax(np.r_[t, PAD] == PAD)) for t in out.tokens]
    prompts = [np.asarray(p)[np.asarray(p) != PAD].astype(np.int32) for p in out.padded_prompt_tokens]
    comps = [np.asarray(t[:n], np.int32) for t, n in zip(out.tokens, lengths)]
    logps = [np.asarray(lp[:n], np.float32) for lp, n in zip(out.logprobs, lengths)]
    return prompts, comps, logps


def _trainer_batch(prompts, comps, order, p_width, c_width, fillers=0, seed=0):
    """The sequences `order` (after `fillers` random others) left-padded to p_width and right-padded to
    c_width: (prompt [B, p_width], completion [B, c_width], the batch row of each sequence)."""
    rng = np.random.default_rng(seed)
    b = fillers + len(order)
    prompt = np.full((b, p_width), PAD, np.int32)
    comp = np.full((b, c_width), PAD, np.int32)
    for r in range(fillers):
        n = 1 + r % p_width
        prompt[r, p_width - n :] = rng.integers(3, V, n)
        comp[r, : c_width - r % 2] = rng.integers(3, V, c_width - r % 2)
    rows = {}
    for r, i in enumerate(order, start=fillers):
        prompt[r, p_width - len(prompts[i]) :] = prompts[i]
        comp[r, : len(comps[i])] = comps[i]
        rows[i] = r
    return prompt, comp, rows


def _bit_compare(recorded, train, rows):
    """(tokens whose float32 bits differ, how many tokens, K3): the sampler's recorded logprob of every
    generated token vs the trainer's of the same token; K3 = mean((r - 1) - log r), r = p_train / p_roll."""
    a = np.concatenate([recorded[i] for i in rows])
    b = np.concatenate([np.asarray(train, np.float32)[r, : len(recorded[i])] for i, r in rows.items()])
    mismatches = int(np.sum(a.view(np.uint32) != b.view(np.uint32)))
    d = b.astype(np.float64) - a.astype(np.float64)
    return mismatches, a.size, float(np.mean(np.expm1(d) - d))


BODY_MODELS = [("qwen3", False, None), ("qwen3", False, "bfloat16"), ("llama3", True, None), ("qwen2", True, None)]


@pytest.mark.parametrize(
    "kind,tied,dtype", BODY_MODELS, ids=[f"{k}-{'tied' if t else 'untied'}-{d or 'float32'}" for k, t, d in BODY_MODELS]
)
def test_body_rollout_logps_equal_trainer_logps_bit_for_bit(kind, tied, dtype, record_property):
    """patch(body="batch_invariant") under strict mode (invariant backends only, no fallback): every token
    the vanilla Sampler generates (prefill and decode steps, 4 prompts padded to 8 slots, a 72-slot cache)
    has, bit for bit, the logprob the trainer gives the same (prompt, completion) in other batches: the
    learners' jitted compute_per_token_logps on 6 rows in another order with two other sequences and wider
    padding, and per_token_logps called directly on 2 rows with no padding but the shorter prompt's."""
    kw = {"dtype": jnp.dtype(dtype)} if dtype else {}
    model = make_model(kind, tied, **kw)
    with detlogp_jax.strict_mode(), dt.patch(body="batch_invariant"):
        prompts, comps, recorded = _body_rollout(model)
        assert all(len(c) >= 4 for c in comps), [len(c) for c in comps]
        prompt, comp, rows = _trainer_batch(prompts, comps, [2, 0, 3, 1], p_width=11, c_width=BODY_STEPS + 3, fillers=2)
        train = tunix_logps(model, prompt, comp, temperature=BODY_T)  # the learners' entry (jitted)
        prompt2, comp2, rows2 = _trainer_batch(prompts, comps, [3, 1], p_width=3, c_width=BODY_STEPS)
        train2 = dt.per_token_logps(model, prompt2, comp2, pad_id=PAD, eos_id=EOS, temperature=BODY_T)
    for name, got, where in (("6 rows", train, rows), ("2 rows", train2, rows2)):
        mismatches, n, k3 = _bit_compare(recorded, got, where)
        record_property(f"{name}: mismatching tokens", f"{mismatches}/{n}")
        print(
            f"{kind} {dtype or 'float32'} body=batch_invariant, trainer {name}: {mismatches}/{n} tokens differ, K3={k3}"
        )
        assert mismatches == 0 and k3 == 0.0, (name, mismatches, n, k3)


@pytest.mark.slow
def test_without_the_body_patch_the_same_comparison_drifts(monkeypatch, record_property):
    """The negative control: the same rollout and trainer batches with Tunix's own body (patch() with
    body=None: the op head, Tunix's einsums / softmax / norms) give other bytes; the final hidden states
    of the sampler and of the trainer already differ (the drift is the body's, not the head's). The same
    Sampler then patched with the body compiles its steps anew (its compiled steps are keyed by the body)."""
    model = make_model("qwen3", False)
    s = _sampler(model, BODY_CACHE)
    seen = []  # the sampler's final hidden states, per step
    real = dt.token_logps

    def spy(m, hidden, tokens, **kw):
        jax.debug.callback(lambda h: seen.append(np.asarray(h)), hidden, ordered=True)
        return real(m, hidden, tokens, **kw)

    monkeypatch.setattr(dt, "token_logps", spy)
    with dt.patch():
        prompts, comps, recorded = _body_rollout(model, sampler=s)
        prompt, comp, rows = _trainer_batch(prompts, comps, [2, 0, 3, 1], p_width=11, c_width=BODY_STEPS + 3, fillers=2)
        train = tunix_logps(model, prompt, comp, temperature=BODY_T)
        ids, positions, mask, seg = common.process_ids(jnp.asarray(prompt), jnp.asarray(comp), PAD, EOS)
        h_train, _ = jax.jit(
            lambda ids, positions, mask, seg: dt.hidden_states(
                model, ids, positions=positions, cache=None, attention_mask=mask, segment_ids=seg
            )
        )(ids, positions, mask, seg)
    mismatches, n, k3 = _bit_compare(recorded, train, rows)
    h_roll = np.stack(seen[:BODY_STEPS], 1)  # [4, steps, D]
    h_train = np.asarray(h_train)[:, prompt.shape[1] - 1 : prompt.shape[1] - 1 + BODY_STEPS]
    hidden_rows = sum(
        row_mismatches(h_train[r, : len(comps[i])], h_roll[i, : len(comps[i])])[0] for i, r in rows.items()
    )
    record_property("mismatching tokens", f"{mismatches}/{n}")
    record_property("mismatching hidden-state rows", hidden_rows)
    print(f"qwen3 body=None: {mismatches}/{n} tokens differ (K3={k3:.3g}); {hidden_rows}/{n} hidden-state rows differ")
    assert hidden_rows > 0
    assert mismatches > 0
    monkeypatch.setattr(dt, "token_logps", real)
    with dt.patch(body="batch_invariant"):
        _, comps_body, recorded_body = _body_rollout(model, sampler=s)
    assert {key[2] for key in s.__dict__["_detlogp_compiled"]} == {(None, "auto"), ("batch_invariant", "auto")}
    assert any(
        (a.view(np.uint32) != b.view(np.uint32)).any() for a, b in zip(recorded_body, recorded) if a.size == b.size
    )  # the body's bytes, not a cached trace of Tunix's body


@pytest.mark.slow
def test_body_backward_is_finite_and_close_to_tunix():
    """The body ops' custom VJPs (plain jnp backward) make the patched learner forward differentiable:
    the gradient of a masked logprob sum (left-padded prompts, right-padded completions: padding rows
    present) is finite and close to Tunix's own body's."""
    model = make_model("qwen3", False, layers=1)
    prompt, comp = batch(seed=6)
    mask = jnp.asarray(comp != PAD, jnp.float32)
    gd, st = nnx.split(model)

    def loss(st):
        lp = dt.per_token_logps(nnx.merge(gd, st), prompt, comp, pad_id=PAD, eos_id=EOS, temperature=0.7)
        return jnp.sum(lp * mask)

    want = jax.grad(loss)(st)
    with dt.patch(body="batch_invariant"):
        got = jax.jit(jax.grad(loss))(st)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all(), jax.tree_util.keystr(path)
        assert np.abs(a - b).max() <= 1e-4 * max(np.abs(b).max(), 1.0), jax.tree_util.keystr(path)


@pytest.mark.slow
def test_body_hidden_states_called_directly_or_under_jit():
    """While the body is patched, hidden_states / per_token_logps compile their forward (with Python
    flags such as output_hidden_states static): a direct call gives the bytes of a call inside a jit."""
    model = make_model("qwen3", False, layers=1)
    prompt, comp = batch(seed=3)
    ids, positions, mask, _ = common.process_ids(jnp.asarray(prompt), jnp.asarray(comp), PAD, EOS)
    kw = dict(positions=positions, cache=None, attention_mask=mask)
    with dt.patch(body="batch_invariant"):
        direct, _ = dt.hidden_states(model, ids, output_hidden_states=True, **kw)
        traced, _ = jax.jit(lambda ids, kw: dt.hidden_states(model, ids, **kw))(ids, kw)
        lp = dt.per_token_logps(model, prompt, comp, pad_id=PAD, eos_id=EOS)
        lp_traced = jax.jit(lambda p, c: dt.per_token_logps(model, p, c, pad_id=PAD, eos_id=EOS))(prompt, comp)
    assert_bitwise_equal(direct, traced, "hidden states")
    assert_bitwise_equal(lp, lp_traced, "per_token_logps")


def test_body_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="body must be one of"):
        dt.patch(body="fast")
    with pytest.raises(ValueError, match="body_backend must be 'auto' or a registered body backend"):
        dt.patch(body="batch_invariant", body_backend="cuda")
    assert not dt.is_patched()
    prompt, comp = batch(seed=1)
    qwen3 = make_model("qwen3", False, layers=1)
    moe = tunix_qwen3.Qwen3(dataclasses.replace(qwen3.config, num_experts=2, num_experts_per_tok=1), rngs=nnx.Rngs(0))
    gemma3 = make_model("gemma3", True, layers=1)
    with dt.patch(body="batch_invariant"):
        with pytest.raises(dt.UnsupportedModelError, match=r"does not cover Gemma3: .*sliding-window.*covered: Qwen3"):
            dt.per_token_logps(gemma3, prompt, comp, pad_id=PAD, eos_id=EOS)
        with pytest.raises(dt.UnsupportedModelError, match="does not cover Gemma3"):  # the sampler's steps too
            _sampler(gemma3)(PROMPTS, max_generation_steps=2, max_prompt_length=4)
        with pytest.raises(dt.UnsupportedModelError, match="Qwen3 with experts"):
            dt.per_token_logps(moe, prompt, comp, pad_id=PAD, eos_id=EOS)
        with pytest.raises(dt.UnsupportedModelError, match="Qwen3 with experts"):  # the patched block itself
            ids, positions, mask, _ = common.process_ids(jnp.asarray(prompt), jnp.asarray(comp), PAD, EOS)
            moe(ids, positions, None, mask)
        seg = jnp.ones(comp.shape, jnp.int32)
        with pytest.raises(NotImplementedError, match="packed sequences"):
            dt.per_token_logps(
                qwen3, prompt[:, :0], comp, pad_id=PAD, eos_id=EOS, segment_ids=seg, segment_positions=seg
            )
    # strict mode: the body's backend must be invariant and serve without a fallback
    with detlogp_jax.strict_mode():
        with dt.patch(body="batch_invariant", body_backend="xla"):
            with pytest.raises(detlogp_jax.StrictModeError, match="'xla' is not batch invariant"):
                dt.per_token_logps(qwen3, prompt, comp, pad_id=PAD, eos_id=EOS)
        if not body_backends.get("pallas_sm90").available():  # here: CPU
            with dt.patch(body="batch_invariant", body_backend="pallas_sm90"):
                with pytest.raises(detlogp_jax.StrictModeError, match="strict mode forbids falling back"):
                    dt.per_token_logps(qwen3, prompt, comp, pad_id=PAD, eos_id=EOS)
    if not body_backends.get("pallas_sm90").available():  # an explicit backend never falls back either
        with dt.patch(body="batch_invariant", body_backend="pallas_sm90"):
            with pytest.raises(detlogp_jax.BackendUnavailableError, match="'pallas_sm90' is not available"):
                dt.per_token_logps(qwen3, prompt, comp, pad_id=PAD, eos_id=EOS)


def test_body_patch_replaces_and_restores_the_model_classes():
    from tunix.models.gemma3 import model as gemma3_mod
    from tunix.models.llama3 import model as llama3_mod
    from tunix.models.qwen2 import model as qwen2_mod

    slots = [
        (cls, name)
        for mod in (tunix_qwen3, qwen2_mod, llama3_mod)
        for cls, name in ((mod.Attention, "block"), (mod.MLP, "block"), (mod.RMSNorm, "__call__"))
    ]
    untouched = [(gemma3_mod.Attention, "block"), (gemma3_mod.RMSNorm, "__call__")]
    before = {slot: vars(slot[0])[slot[1]] for slot in slots + untouched}
    with dt.patch():  # body=None (the default): the model classes are Tunix's
        assert all(vars(c)[n] is before[(c, n)] for c, n in slots)
    h = dt.patch(body="batch_invariant")
    assert h.owner and h.config.body == "batch_invariant" and h.config.body_backend == "auto"
    assert all(vars(c)[n] is not before[(c, n)] for c, n in slots)
    assert all(vars(c)[n] is before[(c, n)] for c, n in untouched)
    assert not dt.patch(body="batch_invariant").owner  # idempotent
    with pytest.raises(RuntimeError, match="already patched"):
        dt.patch()  # another body
    with pytest.raises(RuntimeError, match="already patched"):
        dt.patch(body="batch_invariant", body_backend="reference")
    assert dt.unpatch() is True
    assert all(vars(c)[n] is before[(c, n)] for c, n in slots + untouched)
    with dt.patch(body="batch_invariant", body_backend="reference"):
        pass
    assert not dt.is_patched() and all(vars(c)[n] is before[(c, n)] for c, n in slots)
