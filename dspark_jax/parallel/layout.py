"""The tensor-parallel layout's former home: its rules are `dspark_jax.models.layout` (the models
follow them, so they sit in the models' layer); this module keeps the old import path working."""

from dspark_jax.models.layout import (FUSED_COLUMNS, ROW_SPLIT, Plan, cache_spec,  # noqa: F401
                                      check_divisible, constrain_cache, constrain_pool,
                                      param_spec, plan_devices)
