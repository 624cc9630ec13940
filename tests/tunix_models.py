"""Tiny random Tunix models and a word tokenizer for tests/test_tunix.py and tests/tunix_tp_cases.py
(importing this module imports tunix)."""

from __future__ import annotations

import numpy as np

V = 200  # vocabulary of the tiny models (wider than one 64-column tile of the op, not a multiple of it)
PAD, BOS, EOS = 0, 1, 2


def make_model(kind: str, tied: bool, *, vocab: int = V, layers: int = 2, seed: int = 0, dtype=None):
    """A random float32 Tunix model: kind in {"qwen3", "llama3", "gemma3", "qwen2"}."""
    import jax.numpy as jnp
    from flax import nnx

    rngs = nnx.Rngs(seed)
    dims = dict(num_layers=layers, embed_dim=32, hidden_dim=48, num_heads=4, head_dim=8, num_kv_heads=2)
    if kind == "qwen3":
        from tunix.models.qwen3 import model as m

        dt = jnp.float32 if dtype is None else dtype
        cfg = m.ModelConfig(
            vocab_size=vocab,
            rope_theta=10_000,
            norm_eps=1e-6,
            use_tied_embedding=tied,
            dtype=dt,
            param_dtype=dt,
            **dims,
        )
        return m.Qwen3(cfg, rngs=rngs)
    if kind == "qwen2":
        from tunix.models.qwen2 import model as m

        cfg = m.ModelConfig(
            vocab_size=vocab,
            rope_theta=10_000,
            norm_eps=1e-6,
            use_tied_embedding=tied,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            **dims,
        )
        return m.Qwen2(cfg, rngs=rngs)
    if kind == "llama3":
        from tunix.models.llama3 import model as m

        cfg = m.ModelConfig(vocab_size=vocab, rope_theta=10_000, norm_eps=1e-5, weight_tying=tied, **dims)
        return m.Llama3(cfg, rngs=rngs)
    if kind == "gemma3":
        from tunix.models.gemma3 import model as m

        if not tied:
            raise ValueError("Gemma3 is always tied")
        dims.update(num_heads=2, head_dim=16, num_kv_heads=1)
        cfg = m.ModelConfig(num_embed=vocab, sliding_window_size=8, param_dtype=jnp.float32, **dims)
        return m.Gemma3(cfg, rngs=rngs)
    raise ValueError(kind)


class WordTokenizer:
    """Token i is the word 'w{i}' (the interface Tunix's TokenizerAdapter accepts)."""

    def encode(self, text, **kw):
        return [int(w[1:]) for w in str(text).split()]

    def decode(self, ids, **kw):
        return " ".join(f"w{int(i)}" for i in ids)

    def bos_id(self):
        return BOS

    def eos_id(self):
        return EOS

    def pad_id(self):
        return PAD


def batch(seed: int = 0, b: int = 3, p: int = 5, c: int = 4, vocab: int = V):
    """Left-padded prompts [b, p] and right-padded completions [b, c] (int32, pad = 0), each row with
    a different amount of padding; no pad/eos ids inside the real tokens."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, vocab, (b, p)).astype(np.int32)
    comp = rng.integers(3, vocab, (b, c)).astype(np.int32)
    for i in range(b):
        prompt[i, : i % p] = PAD  # left padding
        comp[i, c - (i % c) :] = PAD  # right padding
    return prompt, comp
