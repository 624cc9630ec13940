"""Applications above the op core: they use `detlogp_jax`, the core never imports them.

* `parity`, `claims`, `metrics`, `report`, `cli`: the RL parity validation, the
  project's main job (`python -m detlogp_jax.validate`, `bash scripts/run.sh`):
  rollout decode vs trainer re-scoring of the same sampled tokens.
* `toy_lm`: the small random Flax NNX decoder LM both sides of that run use.
* `golden`: the golden fingerprint replay/record tool (`python -m detlogp_jax.golden`);
  its records ship as package data (`data/fingerprints.json`).

Nothing here is imported by `import detlogp_jax`; the submodules load on use.
"""
