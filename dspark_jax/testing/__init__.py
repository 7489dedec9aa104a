"""Independent references for distribution checks: exact laws, chi-square, and a toy model pair.

* `law_checks`: float64 NumPy reference laws (draft, target, speculative decode) and the chi-square
  statistic, sharing no code with the implementation.
* `toy_markov`: a Markov target and a real DSpark draft over a tiny vocabulary, and the propose →
  verify loop that decodes them.
"""
