"""Privacy: the exponential-mechanism text sanitizer (:mod:`~fedcompress.privacy.sanitize`,
PPC-GPT's client-side perturbation) and leakage analyses of shared masks
(:mod:`~fedcompress.privacy.leakage`); later DP training and attacks."""
