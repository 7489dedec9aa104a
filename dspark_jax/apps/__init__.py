"""The command line and what it runs: ``dspark-jax demo``, ``eval``, ``probe``, ``sampler-demo``.

* `cli`: argument parsing and dispatch.
* `demo`: the shipped pair decoding held-out prompts.
* `evaluation`: the acceptance study (DSpark drafter against its parallel ablation).
* `sampler_demo`: the draft sampler alone on random weights.
"""
