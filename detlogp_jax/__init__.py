"""detlogp-jax: bitwise-deterministic, batch-invariant log-probabilities of chosen tokens.

`linear_logp(hidden, weight, targets, ...)` fuses the lm_head projection with a
streaming vocabulary log-sum-exp under a frozen numeric contract
(`detlogp_jax.contract`, `docs/CONTRACT.md`).
"""

from detlogp_jax.api import LogpOutput, last_provenance, linear_logp, provenance
from detlogp_jax.backends import StrictModeError, BackendUnavailableError, strict_mode
from detlogp_jax.contract import CONTRACT_ID, CONTRACT_VERSION, ContractError, canonical_padded_vocab, split_bounds

__version__ = "0.1.0"

__all__ = [
    "CONTRACT_ID",
    "CONTRACT_VERSION",
    "ContractError",
    "LogpOutput",
    "StrictModeError",
    "BackendUnavailableError",
    "canonical_padded_vocab",
    "last_provenance",
    "linear_logp",
    "provenance",
    "split_bounds",
    "strict_mode",
]
