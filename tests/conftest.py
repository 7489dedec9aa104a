import os
import subprocess
import sys

import pytest

# Tests run on the CPU (CI has no GPU); keep XLA from grabbing every core for one op. With
# DSPARK_TEST_GPU=1 JAX picks its platform as usual, so the same tests run on a GPU host (tests
# marked `gpu` run only there).
if os.environ.get("DSPARK_TEST_GPU") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:  # pytest's workers (pytest-xdist) share the GPU: none may take most of its memory up front
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  # float32 products at full precision, as on the CPU: a GPU's default is TF32 (~1e-3 relative),
  # which the float32 equality tests' tolerances (1e-5) are not derived from.
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Eight CPU devices, for the sharding tests (tests/test_sharding.py); every other test runs on the
# first, as before. Set before JAX is imported (XLA reads it when the CPU client starts).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
# On the CPU most of a test's time is XLA compiling tiny programs, and most of that is LLVM's
# optimisation of the generated code. The test programs are too small for it to pay: compile them
# at LLVM's lowest level (the same HLO, the same arithmetic: no verdict changes). Subprocesses
# (notebooks, the CLI) inherit it.
if os.environ.get("DSPARK_TEST_GPU") != "1" and "xla_backend_optimization_level" not in \
    os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# Most of what is left is XLA's CPU fusion emitters (its default MLIR pipeline): the classic
# elemental emitters compile the same fused HLO in about 60% of the time (a test_decoding decode
# program: 1.4 s against 2.4 s; the suite's CPU time 1,150 s against 1,550 s). Every test program
# is compiled the same way, so programs that tests compare are still compiled alike. XLA aborts
# on a flag it does not know: set only where a child process shows that this jaxlib takes it
# (once: pytest-xdist's workers and the CLI inherit the variable). Not in the notebooks' kernels:
# they run the shipped pair, where the fusion emitters' faster code wins (the two small notebooks:
# 51 s of CPU with them, 91 s without); see pytest_runtest_call.
_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if os.environ.get("DSPARK_TEST_GPU") != "1" and "xla_cpu_use_fusion_emitters" not in \
    os.environ.get("XLA_FLAGS", ""):
  _probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                          env=dict(os.environ, XLA_FLAGS=_EMITTERS, JAX_PLATFORMS="cpu"))
  if _probe.returncode == 0:
    os.environ["XLA_FLAGS"] += " " + _EMITTERS
# Each pytest-xdist worker runs XLA's CPU programs on one thread. The test programs are tiny: with
# Eigen's thread pool in every worker, the workers' threads outnumber the cores and the pool's
# hand-offs cost more than they save (tests/test_verification_law.py with tests/test_sampling.py on
# 2 workers, 2 cores: 88 s with the pool, 50 s without). Programs compare alike: every one, the
# notebooks' and the CLI's included (they inherit the variable), runs single-threaded.
if os.environ.get("DSPARK_TEST_GPU") != "1" and "xla_cpu_multi_thread_eigen" not in \
    os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
# The backend a test asks for, not one forced from the environment (tests that need the variable
# set it themselves); likewise the memory gate's mode and the attention implementation.
os.environ.pop("DSPARK_JAX_BACKEND", None)
os.environ.pop("DSPARK_JAX_FOLDED_SAMPLING", None)
os.environ.pop("DSPARK_JAX_ATTENTION", None)
# One persistent compilation cache for the whole run, in a fresh directory (nothing carries over
# between runs): a program compiled in one process (a pytest-xdist worker, a notebook's kernel,
# the CLI in a subprocess) is loaded, not compiled again, by the others. JAX keys each entry by
# the program, its compile options and XLA's flags, so no test sees another program than it
# would compile itself. The first process to import this file (pytest's controller) makes the
# directory; the workers and subprocesses inherit the variables. On the CPU only: the GPU check
# runs its tests as it always has.
if os.environ.get("DSPARK_TEST_GPU") != "1" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  _cache_dir = tempfile.mkdtemp(prefix="dspark_test_xla_cache_")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def _file_cost(items) -> dict:
  """A file's expected seconds on one worker, from its markers: ~15 per `slow` test, ~1 per other
  test, ~40 per notebook (a whole study)."""
  cost = {}
  for item in items:
    each = 40 if item.path.suffix == ".ipynb" else 15 if item.get_closest_marker("slow") else 1
    cost[item.path] = cost.get(item.path, 0) + each
  return cost


def pytest_collection_modifyitems(config, items):
  """Notebooks (run by nbmake) count as `slow`: each runs a whole study. Tests marked `gpu` are
  skipped unless JAX's default backend is a GPU.

  Files run costliest first (by `_file_cost`; ties in path order, a file's tests in their own
  order). pytest-xdist's ``--dist loadfile --no-loadscope-reorder`` hands whole files to whichever
  worker is free in this order, so the long files start early and the short ones fill the end (by
  test count instead, the one-test notebooks came last and one worker ran on alone)."""
  for item in items:
    if item.path.suffix == ".ipynb":
      item.add_marker(pytest.mark.slow)
  cost = _file_cost(items)
  items.sort(key=lambda item: (-cost[item.path], str(item.path)))
  gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
  if not gpu_items:
    return
  import jax
  backend = jax.default_backend()
  if backend == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs a GPU (JAX's default backend is {backend!r}; on a GPU "
                                 "host run with DSPARK_TEST_GPU=1)")
  for item in gpu_items:
    item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  """A notebook's kernel (started in this phase, from this environment) compiles with XLA's
  default CPU emitters (see _EMITTERS above). The worker's own XLA, if it runs, read its flags
  before (at collection: jax.default_backend()); XLA reads them once per process."""
  flags = os.environ.get("XLA_FLAGS", "")
  if item.path.suffix != ".ipynb" or _EMITTERS not in flags:
    return (yield)
  os.environ["XLA_FLAGS"] = flags.replace(_EMITTERS, "").strip()
  try:
    return (yield)
  finally:
    os.environ["XLA_FLAGS"] = flags
