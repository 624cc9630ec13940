"""The toy LM's batch-invariant body (`detlogp_jax.apps.toy_lm`, body="batch_invariant") on CPU:
the rollout's decode steps and the trainer's full-sequence forward give the same hidden-state
bytes, whatever batch each side runs; the plain XLA body (the negative control) does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from detlogp_jax.apps.toy_lm import ToyLM, ToyLMConfig
from tests.helpers import row_mismatches

B, L = 5, 16


def _model(dtype):
    cfg = ToyLMConfig(vocab_size=500, padded_vocab_size=512, d_model=64, n_layers=1, n_heads=2, d_ff=128, max_len=L)
    return ToyLM(ToyLMConfig(**{**cfg.__dict__, "dtype": dtype}), rngs=nnx.Rngs(0))


def _decode_all(model, tokens, body):
    cache = model.init_cache(tokens.shape[0])
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c, body=body))
    hs = []
    for p in range(tokens.shape[1]):
        h, cache = step(model, tokens[:, p], jnp.int32(p), cache)
        hs.append(np.asarray(h, np.float32))
    return np.stack(hs, axis=1)  # [B, L, D]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_equals_prefill_in_other_batches(dtype):
    model = _model(dtype)
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, 500)
    dec = _decode_all(model, tokens, "batch_invariant")
    fwd = nnx.jit(lambda m, t: m.hidden(t, body="batch_invariant"))
    order = [3, 0, 4, 1, 2]
    parts = [np.asarray(fwd(model, tokens[np.array(order[i : i + 2])]), np.float32) for i in (0, 2)]
    last = jnp.concatenate([tokens[np.array(order[4:])], tokens[:6]])  # one sequence among 6 others
    parts.append(np.asarray(fwd(model, last), np.float32)[:1])
    pre = np.empty_like(dec)
    pre[np.array(order)] = np.concatenate(parts)
    assert row_mismatches(pre.reshape(B * L, -1), dec.reshape(B * L, -1))[0] == 0


def test_plain_xla_body_differs():
    model = _model(jnp.float32)
    tokens = jax.random.randint(jax.random.key(2), (B, L), 0, 500)
    dec = _decode_all(model, tokens, "xla")
    pre = np.asarray(model.hidden(tokens, body="xla"), np.float32)
    rows, mad = row_mismatches(pre.reshape(B * L, -1), dec.reshape(B * L, -1))
    assert rows > 0 and mad < 1e-4


def test_unknown_body_is_refused():
    with pytest.raises(ValueError, match="body must be one of"):
        _model(jnp.float32).hidden(jnp.zeros((1, 4), jnp.int32), body="fast")
