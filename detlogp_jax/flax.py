"""Short name of `detlogp_jax.integrations.flax` (the Flax NNX `LogpHead`)."""

from detlogp_jax.integrations.flax import LogpHead, LogpOutput, masked_mean_nll

__all__ = ["LogpHead", "LogpOutput", "masked_mean_nll"]
