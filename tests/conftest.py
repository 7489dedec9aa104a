import os

# Tests run on the CPU (CI has no GPU); keep XLA from grabbing every core for one op.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
