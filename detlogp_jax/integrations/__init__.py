"""Integrations with model libraries; they stand above the op core and `sharding`.

* `detlogp_jax.integrations.flax`: `LogpHead`, a Flax NNX lm_head whose output is `linear_logp`.
"""
