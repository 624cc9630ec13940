"""Integrations with model libraries; they stand above the op core and `sharding`.

* `detlogp_jax.integrations.flax`: `LogpHead`, a Flax NNX lm_head whose output is `linear_logp`.
* `detlogp_jax.integrations.tunix`: Tunix's per-token logprobs (trainer and vanilla sampler)
  through `linear_logp`, and `patch()` to route a Tunix RL learner through them (needs the
  optional `tunix` extra; imported only when used).
"""
