import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax.sampling import (
    SampleResult,
    SamplingProgram,
    gather_logp,
    processed_logprob,
    processed_logprobs,
    sample,
)
from tests.helpers import bits

PROGRAMS = [
    SamplingProgram(),
    SamplingProgram(temperature=0.7),
    SamplingProgram(temperature=1.3, top_k=5),
    SamplingProgram(top_k=1),
    SamplingProgram(top_p=0.9),
    SamplingProgram(temperature=0.6, top_p=0.5),
    SamplingProgram(min_p=0.05),
    SamplingProgram(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02),
]


def rand_logits(seed, shape, ties=False):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    if ties:  # coarse grid -> many exact ties
        x = np.round(x * 2) / 2
    return jnp.asarray(x)


@pytest.mark.parametrize("program", PROGRAMS, ids=str)
def test_replay_is_bit_exact(program):
    for seed in range(6):
        logits = rand_logits(seed, (8, 257), ties=seed % 2 == 1)
        res = sample(logits, program, jax.random.key(seed))
        replay = processed_logprob(logits, program, res.token)
        np.testing.assert_array_equal(bits(replay), bits(res.processed_logprob))
        assert np.all(np.isfinite(res.processed_logprob))
        assert np.all(np.asarray(res.processed_logprob) <= 0)


def test_replay_is_batch_invariant_and_jit_stable():
    logits = rand_logits(1, (16, 1000))
    program = PROGRAMS[-1]
    res = sample(logits, program, jax.random.key(3))
    jitted = jax.jit(sample, static_argnames="program")(logits, program, jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(jitted.token), np.asarray(res.token))
    np.testing.assert_array_equal(bits(jitted.processed_logprob), bits(res.processed_logprob))
    for i in (0, 7, 15):
        one = processed_logprob(logits[i : i + 1], program, res.token[i : i + 1])
        assert bits(one)[0] == bits(res.processed_logprob)[i]
    table = processed_logprobs(logits, program)
    for i in (0, 9):
        np.testing.assert_array_equal(bits(processed_logprobs(logits[i], program)), bits(table[i]))


def test_leading_batch_dims_and_per_row_keys():
    logits = rand_logits(2, (2, 3, 64))
    program = SamplingProgram(temperature=0.8, top_p=0.9)
    keys = jax.random.split(jax.random.key(0), 6).reshape(2, 3)
    res = sample(logits, program, keys)
    assert res.token.shape == (2, 3) and res.token.dtype == jnp.int32
    assert res.processed_logprob.shape == (2, 3)
    # With one key per row, a row's token does not depend on the rest of the batch.
    for i in range(2):
        for j in range(3):
            single = sample(logits[i, j], program, keys[i, j])
            assert int(single.token) == int(res.token[i, j])
            assert bits(single.processed_logprob) == bits(res.processed_logprob[i, j])
    with pytest.raises(ValueError):
        sample(logits, program, jax.random.split(jax.random.key(0), 5))


def test_determinism_for_fixed_key():
    logits = rand_logits(4, (32, 100))
    program = SamplingProgram(temperature=1.5)
    a = sample(logits, program, jax.random.key(7))
    b = sample(logits, program, jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(a.token), np.asarray(b.token))
    np.testing.assert_array_equal(bits(a.processed_logprob), bits(b.processed_logprob))
    raw = sample(logits, program, jax.random.PRNGKey(7))  # raw uint32 key data
    np.testing.assert_array_equal(np.asarray(a.token), np.asarray(raw.token))
    c = sample(logits, program, jax.random.key(8))
    assert not np.array_equal(np.asarray(a.token), np.asarray(c.token))


def test_top_k_1_is_argmax_with_logprob_zero_and_ties_go_to_lower_id():
    logits = rand_logits(5, (10, 50))
    logits = logits.at[3, [4, 9, 30]].set(100.0)  # tie for the max
    for seed in range(4):
        res = sample(logits, SamplingProgram(temperature=0.3, top_k=1), jax.random.key(seed))
        expected = np.argmax(np.asarray(logits), axis=-1)
        np.testing.assert_array_equal(np.asarray(res.token), expected)
        assert int(res.token[3]) == 4
        np.testing.assert_array_equal(bits(res.processed_logprob), np.zeros(10, np.uint32))


def test_top_k_ties():
    logits = jnp.array([0.0, 5.0, 5.0, 5.0, 1.0])
    lp = np.asarray(processed_logprobs(logits, SamplingProgram(top_k=2)))
    np.testing.assert_array_equal(np.isfinite(lp), [False, True, True, False, False])
    np.testing.assert_allclose(lp[1:3], math.log(0.5), rtol=1e-6)
    lp = np.asarray(processed_logprobs(logits, SamplingProgram(top_k=4)))
    np.testing.assert_array_equal(np.isfinite(lp), [False, True, True, True, True])
    # k >= V keeps everything, identical to top_k off.
    np.testing.assert_array_equal(
        bits(processed_logprobs(logits, SamplingProgram(top_k=5))), bits(processed_logprobs(logits, SamplingProgram()))
    )


def kept(lp):
    return np.isfinite(np.asarray(lp))


def test_top_p_semantics():
    logits = jnp.log(jnp.array([0.125, 0.5, 0.125, 0.25]))  # ranks: 1, 3, 0, 2
    cases = {0.4: [0, 1, 0, 0], 0.6: [0, 1, 0, 1], 0.8: [1, 1, 0, 1], 0.9: [1, 1, 1, 1]}
    for top_p, expect in cases.items():
        lp = processed_logprobs(logits, SamplingProgram(top_p=top_p))
        np.testing.assert_array_equal(kept(lp), np.array(expect, bool), err_msg=str(top_p))
    # Always keep the first token, even for tiny top_p.
    np.testing.assert_array_equal(
        kept(processed_logprobs(logits, SamplingProgram(top_p=1e-6))), [False, True, False, False]
    )


def test_min_p_semantics():
    logits = jnp.log(jnp.array([0.5, 0.25, 0.125, 0.125]))
    for min_p, expect in {0.2: [1, 1, 1, 1], 0.3: [1, 1, 0, 0], 0.6: [1, 0, 0, 0]}.items():
        lp = processed_logprobs(logits, SamplingProgram(min_p=min_p))
        np.testing.assert_array_equal(kept(lp), np.array(expect, bool), err_msg=str(min_p))


def test_pinned_order_top_k_before_top_p():
    logits = jnp.log(jnp.array([0.4, 0.3, 0.3]))
    # top-k=2 renormalises to [0.571, 0.429]; top-p=0.5 then keeps only the first.
    # (top-p first would have kept two tokens.)
    lp = processed_logprobs(logits, SamplingProgram(top_k=2, top_p=0.5))
    np.testing.assert_array_equal(kept(lp), [True, False, False])
    assert bits(lp)[0] == 0


def test_renormalised_values_and_temperature():
    logits = rand_logits(6, (4, 40))
    program = SamplingProgram(temperature=2.0, top_k=10, top_p=0.8, min_p=0.1)
    lp = np.asarray(processed_logprobs(logits, program))
    scaled = np.asarray(logits, np.float64) / 2.0
    for row, s in zip(lp, scaled):
        m = np.isfinite(row)
        ref = s[m] - np.log(np.sum(np.exp(s[m] - s[m].max()))) - s[m].max()
        np.testing.assert_allclose(row[m], ref, rtol=1e-5, atol=1e-5)
    # The temperature step is exactly logits * (float32(1) / float32(T)).
    p = SamplingProgram(temperature=0.37, top_p=0.9)
    assert p.inv_temperature == np.float32(1) / np.float32(0.37)
    pre = logits * p.inv_temperature
    np.testing.assert_array_equal(
        bits(processed_logprobs(logits, p)), bits(processed_logprobs(pre, SamplingProgram(top_p=0.9)))
    )


def test_sampling_frequencies_and_masked_tokens():
    probs = np.array([0.5, 0.3, 0.2, 0.0], np.float32)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs)), (4000, 4))  # log(0) = -inf
    keys = jax.random.split(jax.random.key(11), 4000)
    tok = np.asarray(sample(logits, SamplingProgram(), keys).token)
    freq = np.bincount(tok, minlength=4) / tok.size
    np.testing.assert_allclose(freq, probs, atol=0.03)
    assert freq[3] == 0


def test_logp_from_op_table_and_callable():
    logits = rand_logits(7, (5, 30))
    table = jax.nn.log_softmax(logits)
    program = SamplingProgram(top_k=3)
    res = sample(logits, program, jax.random.key(0), logp_from_op=table)
    assert isinstance(res, SampleResult)
    expected = np.take_along_axis(np.asarray(table), np.asarray(res.token)[:, None], -1)[:, 0]
    np.testing.assert_array_equal(bits(res.logp), bits(expected))
    res2 = sample(logits, program, jax.random.key(0), logp_from_op=lambda t: gather_logp(table, t))
    np.testing.assert_array_equal(bits(res2.logp), bits(expected))
    assert sample(logits, program, jax.random.key(0)).logp is None
    out = processed_logprob(logits, program, jnp.array([0, 1, 2, 30, -1]))
    assert np.isnan(np.asarray(out)[3:]).all()


def test_bf16_logits_upcast_exactly():
    logits = rand_logits(8, (3, 20)).astype(jnp.bfloat16)
    p = SamplingProgram(top_p=0.7)
    np.testing.assert_array_equal(
        bits(processed_logprobs(logits, p)), bits(processed_logprobs(logits.astype(jnp.float32), p))
    )
    with pytest.raises(TypeError):
        processed_logprobs(jnp.zeros((2, 3), jnp.int32), p)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=-1.0),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(temperature=1e-50),
        dict(temperature=1e40),
        dict(temperature="1"),
        dict(top_k=-1),
        dict(top_k=1.5),
        dict(top_k=True),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(top_p=float("nan")),
        dict(top_p=-0.5),
        dict(min_p=1.0),
        dict(min_p=-0.1),
        dict(min_p=float("nan")),
    ],
)
def test_invalid_programs_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingProgram(**kwargs)


def test_program_is_normalised_and_hashable():
    a = SamplingProgram(1, np.int64(3), 1, 0)
    b = SamplingProgram(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    assert a == b and hash(a) == hash(b) and type(a.top_k) is int and type(a.temperature) is float
    with pytest.raises(Exception):
        a.top_k = 4
