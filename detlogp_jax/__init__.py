"""detlogp-jax: bitwise-deterministic, batch-invariant log-probabilities of chosen tokens.

`linear_logp(hidden, weight, targets, ...)` fuses the lm_head projection with a
streaming vocabulary log-sum-exp under a frozen numeric contract
(`detlogp_jax.contract`, `docs/CONTRACT.md`).
"""

from detlogp_jax.api import LogpOutput, last_provenance, linear_logp, provenance
from detlogp_jax.backends import BackendUnavailableError, StrictModeError, strict_mode
from detlogp_jax.contract import (
    CONTRACT_ID,
    CONTRACT_VERSION,
    ENTROPY_ID,
    ContractError,
    canonical_padded_vocab,
    split_bounds,
)

__version__ = "0.1.0"

# Documented submodules, reachable as attributes (`detlogp_jax.flax.LogpHead`)
# without importing them here: each is imported on first access.
_LAZY_SUBMODULES = frozenset(
    {
        "api",
        "backends",
        "contract",
        "fingerprint",
        "flax",
        "grad",
        "inputs",
        "integrations",
        "numerics",
        "oracle",
        "pipeline",
        "plugins",
        "reference",
        "sampling",
    }
)
# Reachable as `detlogp_jax.linear_logp_tp` etc. without importing `sharding` here.
_TP_ENTRY_POINTS = frozenset({"linear_logp_tp", "linear_logp_local", "tp_partials_and_fold"})


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"detlogp_jax.{name}")
    if name in _TP_ENTRY_POINTS:  # the tensor-parallel package's entry points (`detlogp_jax.plugins`)
        from detlogp_jax import plugins

        return getattr(plugins.tensor_parallel(), name)
    raise AttributeError(f"module 'detlogp_jax' has no attribute {name!r}")


__all__ = [
    "__version__",
    "CONTRACT_ID",
    "CONTRACT_VERSION",
    "ENTROPY_ID",
    "ContractError",
    "LogpOutput",
    "StrictModeError",
    "BackendUnavailableError",
    "canonical_padded_vocab",
    "last_provenance",
    "linear_logp",
    "linear_logp_local",
    "linear_logp_tp",
    "provenance",
    "split_bounds",
    "strict_mode",
]
