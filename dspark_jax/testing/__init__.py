"""Independent references for distribution checks: exact laws, chi-square, and a toy model pair.

* `law_checks`: float64 NumPy reference laws (draft, target, speculative decode) and the chi-square
  statistic, sharing no code with the implementation.
* `toy_markov`: a Markov target and a real DSpark draft over a tiny vocabulary, and the propose →
  verify loop that decodes them.
* `compiling`: `compute_bound_jit`, how a law check's large program compiles under the test suite's
  fast-compile flags.
"""
