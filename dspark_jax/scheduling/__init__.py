"""Confidence-scheduled verification (SPEC §7): which drafts the target checks, and calibration.

* `schedules`: `Schedule(init, update)` and the schedules `fixed`, `threshold`, `prefix` (Algorithm 1)
  and `top_k` (the lagged production variant); the throughput table (`load_sps`, `save_sps`).
* `calibration`: Sequential Temperature Scaling (`fit_sts`) and `ece`, `reliability`, `auc`.
"""

from dspark_jax.scheduling import calibration, schedules

__all__ = ["calibration", "schedules"]
