"""Client-level differential privacy: accounting of (ε, δ) with Google's dp-accounting."""

from fedjax_pfl.privacy.accounting import (
    ACCOUNTANTS,
    MAX_NOISE_MULTIPLIER,
    SAMPLINGS,
    epsilon,
    epsilons,
    noise_multiplier_for,
)

__all__ = ["ACCOUNTANTS", "MAX_NOISE_MULTIPLIER", "SAMPLINGS", "epsilon", "epsilons",
           "noise_multiplier_for"]
