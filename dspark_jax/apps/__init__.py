"""The command line and what it runs: ``dspark-jax demo``, ``generate``, ``eval``, ``calibrate``,
``probe``, ``sampler-demo``.

* `cli`: the parser, ``probe``, ``generate``, ``eval`` and dispatch (`main`).
* `flags`: the flags' argparse value types, the shared model flags and loading what they name.
* `schedule_commands`: ``eval --schedule`` and ``calibrate``.
* `demo`: the shipped pair decoding held-out prompts.
* `evaluation`: the acceptance study (DSpark drafter against its parallel ablation).
* `schedule_specs`: schedules by name (``fixed,threshold:0.5,prefix,top_k``).
* `calibration_study`: traced decodes and the confidence head's STS fit, with its diagnostics.
* `schedule_study`: schedules compared by live decodes and by replaying traces, the throughput
  table.
* `study_figures`: the schedule study's figures.
* `sampler_demo`: the draft sampler alone on random weights.
"""
