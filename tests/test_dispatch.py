"""`dispatch.choose`: the default table, the preconditions, explicit requests, $DSPARK_JAX_BACKEND.

Synthetic `dispatch.Problem`s: the decision depends on shapes, dtypes and the device alone, so a
Hopper GPU's decisions are checked here without one.
"""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.draft import block as proposal
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import pallas_block

XLA, TRITON, HOPPER = dispatch.Backend.XLA, dispatch.Backend.TRITON, dispatch.Backend.HOPPER


def problem(**changes) -> dispatch.Problem:
  """A block on an H200 (compute capability 9.0, 132 multiprocessors) at the benchmark shape:
  greedy-only, B = 128, V = 129280, r = 256, γ = 7, bf16 W2 and logits, a vanilla head."""
  base = dispatch.Problem(platform="gpu", compute_capability="9.0", core_count=132,
                          greedy_only=True, batch=128, vocab=129280, rank=256, gamma=7,
                          w2_dtype="bfloat16", logits_dtype="bfloat16", head_kind="vanilla")
  return dataclasses.replace(base, **changes)


@pytest.fixture(autouse=True)
def _no_backend_from_the_environment(monkeypatch):
  monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


@pytest.mark.parametrize("vocab", [129280, 151936])
@pytest.mark.parametrize("greedy_only,batch", [(True, 128), (False, 64), (False, 128)])
def test_auto_picks_hopper_where_it_was_measured_to_win(greedy_only, batch, vocab):
  # BENCHMARKS.md: greedy-only from 128 rows (v19), sampling at 64 and 128 rows (v32-v37), on a
  # Hopper GPU with bf16 W2 and logits, r = 256.
  choice = dispatch.choose(problem(greedy_only=greedy_only, batch=batch, vocab=vocab))
  assert choice.backend is HOPPER and choice.name == "hopper", choice.reason
  assert choice.config == dispatch.HopperConfig() and not choice.interpret
  assert choice.reason.startswith("auto: hopper (BENCHMARKS.md")


@pytest.mark.parametrize("vocab", [129280, 151936])
@pytest.mark.parametrize("greedy_only,batch", [(True, 1), (True, 8), (True, 64), (False, 1),
                                               (False, 8), (False, 32)])
def test_auto_picks_triton_below_those_batches(greedy_only, batch, vocab):
  choice = dispatch.choose(problem(greedy_only=greedy_only, batch=batch, vocab=vocab))
  assert choice.backend is TRITON, choice.reason
  assert choice.config == dispatch.TritonConfig() and choice.reason.startswith("auto: triton")


@pytest.mark.parametrize("changes,failed", [
    # The greedy kernel keeps all rows of v and two stages of W2 and U_k tiles in shared memory:
    # 258 KB at B = 256, r = 256 (more than 227 KB).
    (dict(batch=256), "the kernel's buffers fit shared memory"),
    (dict(batch=160), "B is a multiple of 64"),
    (dict(greedy_only=False, batch=192), "sampling: B is 64 or a multiple of 128"),
    (dict(greedy_only=False, batch=256), "the kernel's buffers fit shared memory"),
    # 64-column sampler tiles (64 x 2021): the sampling kernel takes 128-column tiles.
    (dict(greedy_only=False, vocab=129344), "sampling: the sampler's vocabulary tile is 128 columns"),
    (dict(greedy_only=False, store_logits=False),
     "the sampling variant stores its corrected logits (store_logits=True)"),
    (dict(w2_dtype="float32"), "W2 and the logits are bfloat16"),      # WGMMA would run at TF32
    (dict(logits_dtype="float32"), "W2 and the logits are bfloat16"),
    (dict(rank=32), "r is a multiple of 64"),
])
def test_auto_takes_triton_where_a_hopper_precondition_fails(changes, failed):
  choice = dispatch.choose(problem(**changes))
  assert choice.backend is TRITON, choice.reason
  assert f"not hopper: {failed}" in choice.reason
  # Asked for explicitly, the same failure is an error naming the precondition.
  with pytest.raises(ValueError, match="^backend 'hopper': precondition failed: " + re.escape(failed)):
    dispatch.choose(problem(**changes), "hopper")


def test_auto_keeps_greedy_hopper_at_256_rows_where_shared_memory_holds_them():
  # Greedy-only B = 256 runs the Hopper kernel where v and the stages fit (r = 64: 115 KB).
  assert dispatch.choose(problem(batch=256, rank=64)).backend is HOPPER
  assert dispatch.choose(problem(batch=256, rank=64, vocab=151936)).backend is HOPPER


def test_auto_takes_triton_on_other_gpus():
  for capability in ("8.0", "8.9", "10.0"):
    choice = dispatch.choose(problem(compute_capability=capability))
    assert choice.backend is TRITON, (capability, choice.reason)
    with pytest.raises(ValueError, match="precondition failed: a Hopper GPU"):
      dispatch.choose(problem(compute_capability=capability), "hopper")


@pytest.mark.parametrize("changes,failed", [
    # The shipped ablation head has rank 1 (it crashed the Hopper kernel on the H200).
    (dict(rank=1, vocab=8192), ("r is a multiple of 64", "r is a multiple of 16")),
    (dict(rank=1, vocab=8192, greedy_only=False, batch=64),
     ("r is a multiple of 64", "r is a multiple of 16")),
    (dict(vocab=129281), ("V is a multiple of 64", "V has a power-of-two tile")),
    (dict(w2_dtype="int8", logits_dtype="int8"), ("W2 and the logits are bfloat16",
                                                  "W2 and the logits are float")),
])
def test_auto_falls_back_to_xla_on_a_gpu_where_the_kernels_cannot_run(changes, failed):
  choice = dispatch.choose(problem(**changes))
  assert choice.backend is XLA, choice.reason
  assert f"not hopper: {failed[0]}" in choice.reason
  assert f"not triton: {failed[1]}" in choice.reason and choice.reason.endswith("xla, the fallback")
  for backend, name in zip(("hopper", "triton"), failed):
    with pytest.raises(ValueError, match=f"^backend '{backend}': precondition failed: {name}"):
      dispatch.choose(problem(**changes), backend)
  assert dispatch.choose(problem(**changes), "xla").backend is XLA  # XLA runs anything


def test_off_the_gpu_auto_is_xla_and_kernels_run_only_when_asked_for():
  cpu = problem(platform="cpu", compute_capability=None)
  choice = dispatch.choose(cpu)
  assert choice.backend is XLA and choice.config == dispatch.XlaConfig(form="loop")
  assert "cpu is not a GPU" in choice.reason and not choice.interpret
  for backend in ("triton", "hopper"):  # explicitly: in Pallas' interpreter
    choice = dispatch.choose(cpu, backend)
    assert choice.name == backend and choice.interpret, choice.reason
    assert choice.reason == f"{backend} requested, in Pallas' interpreter"
  # The interpreter is no Hopper GPU, but the other preconditions still hold there.
  with pytest.raises(ValueError, match="precondition failed: r is a multiple of 64"):
    dispatch.choose(dataclasses.replace(cpu, rank=16), "hopper")


def test_xla_form_defaults():
  assert dispatch.choose(problem(rank=1)).config == dispatch.XlaConfig(form="unrolled")
  assert dispatch.choose(problem(rank=1, greedy_only=False)).config == \
      dispatch.XlaConfig(form="loop")
  assert dispatch.choose(problem(), "xla").config.form == "unrolled"
  assert dispatch.choose(problem(), "xla", dispatch.XlaConfig(form="loop")).config.form == "loop"
  with pytest.raises(ValueError, match="^XlaConfig.form: expected None, 'loop' or 'unrolled'"):
    dispatch.XlaConfig(form="pallas")


def test_configs_go_with_their_backend():
  stages = dispatch.HopperConfig(stages=3)
  assert dispatch.choose(problem(), "hopper", stages).config is stages
  # "auto" applies a config where the table picks its backend, and the default elsewhere.
  assert dispatch.choose(problem(), "auto", stages).config is stages
  triton = dispatch.choose(problem(batch=64), "auto", stages)
  assert triton.backend is TRITON and triton.config == dispatch.TritonConfig()
  with pytest.raises(ValueError, match="^config: TritonConfig is not a setting of backend "
                                       "'hopper' \\(it takes HopperConfig\\)"):
    dispatch.choose(problem(), "hopper", dispatch.TritonConfig(num_warps=8))
  with pytest.raises(ValueError, match="^config: HopperConfig is not a setting of backend 'xla'"):
    dispatch.choose(problem(), "xla", stages)
  with pytest.raises(ValueError, match="^config: expected XlaConfig, TritonConfig or HopperConfig, "
                                       "got dict"):
    dispatch.choose(problem(), "auto", {"stages": 4})
  with pytest.raises(ValueError, match="^config: expected .* got tuple"):
    dispatch.choose(problem(), "hopper", (("stages", 4),))   # the old pallas_options form


def test_backend_names_and_errors():
  assert dispatch.choose(problem(), " Triton ").backend is TRITON
  assert dispatch.choose(problem(), dispatch.Backend.XLA).backend is XLA
  assert dispatch.choose(problem(), "AUTO").backend is HOPPER
  with pytest.raises(ValueError, match="^backend: expected 'auto', 'xla', 'triton' or 'hopper', "
                                       "got 'pallas'"):
    dispatch.choose(problem(), "pallas")
  with pytest.raises(TypeError, match="a Choice is already a decision"):
    dispatch.choose(problem(), dispatch.choose(problem()))
  made = dispatch.choose(problem())
  assert dispatch.resolve(made) is made  # a Choice passes through `resolve` unchanged
  assert hash(made) == hash(dispatch.choose(problem())) and made == dispatch.choose(problem())


@pytest.mark.parametrize("value,expected", [("xla", XLA), ("triton", TRITON), (" HOPPER ", HOPPER),
                                            ("auto", HOPPER), ("", HOPPER)])
def test_the_environment_variable_forces_a_backend(monkeypatch, value, expected):
  monkeypatch.setenv(dispatch.ENV_VAR, value)
  choice = dispatch.choose(problem())
  assert choice.backend is expected, choice.reason
  if value.strip() not in ("", "auto"):
    assert choice.reason == f"{expected.value} requested, on gpu"
  # An explicit argument wins over the variable.
  assert dispatch.choose(problem(), "xla").backend is XLA


def test_the_environment_variable_is_checked(monkeypatch):
  monkeypatch.setenv(dispatch.ENV_VAR, "fused")
  with pytest.raises(ValueError, match=r"^\$DSPARK_JAX_BACKEND: expected 'auto', 'xla', 'triton' "
                                       "or 'hopper', got 'fused'"):
    dispatch.choose(problem())
  # A forced backend whose precondition fails names it.
  monkeypatch.setenv(dispatch.ENV_VAR, "hopper")
  with pytest.raises(ValueError, match="^backend 'hopper': precondition failed: r is a multiple"):
    dispatch.choose(problem(rank=1))


def test_choose_backend_reads_shapes_dtypes_and_the_device():
  # `proposal.choose_backend` builds the problem from the head's arrays and the base logits'
  # shape and dtype (abstract values are enough) on the given device.
  h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", core_count=132)
  spec = jax.ShapeDtypeStruct
  arrays = {"w1": spec((129280, 256), jnp.bfloat16), "w2": spec((256, 129280), jnp.bfloat16)}
  base = spec((128, 7, 129280), jnp.bfloat16)
  greedy = proposal.choose_backend(arrays, base, kind="vanilla", greedy_only=True, device=h200)
  assert greedy.backend is HOPPER
  sampling = proposal.choose_backend(arrays, spec((256, 7, 129280), jnp.bfloat16), kind="vanilla",
                                     greedy_only=False, device=h200)
  assert sampling.backend is TRITON and "not hopper" in sampling.reason
  ablation = {"w1": spec((8192, 1), jnp.bfloat16), "w2": spec((1, 8192), jnp.bfloat16)}
  for greedy_only in (True, False):
    choice = proposal.choose_backend(ablation, spec((128, 7, 8192), jnp.bfloat16), kind="vanilla",
                                     greedy_only=greedy_only, device=h200)
    assert choice.backend is XLA, choice.reason
  cpu = proposal.choose_backend(arrays, base, kind="vanilla", greedy_only=True)
  if jax.default_backend() == "cpu":
    assert cpu.backend is XLA and "cpu is not a GPU" in cpu.reason


def test_table_lists_every_row_and_precondition():
  text = dispatch.table()
  for row in dispatch.DEFAULTS:
    assert row.source in text
  for backend in (TRITON, HOPPER):
    for name, _ in dispatch.PRECONDITIONS[backend]:
      assert name in text


def test_head_arrays_are_prepared_only_for_the_hopper_kernels():
  # `head_arrays_for`: W2 part by part ("w2_parts", [V/64, r, 64]) added, in a new dict, where any
  # choice runs the Hopper kernels; the arrays as they are otherwise, and once prepared.
  w2 = jnp.arange(64 * 640, dtype=jnp.float32).reshape(64, 640).astype(jnp.bfloat16)
  arrays = {"w1": jnp.zeros((640, 64), jnp.bfloat16), "w2": w2}
  cpu = problem(platform="cpu", compute_capability=None, vocab=640, rank=64, batch=64)
  xla, hopper = dispatch.choose(cpu), dispatch.choose(cpu, "hopper")
  assert pallas_block.head_arrays_for(arrays, [xla, dispatch.choose(cpu, "triton")]) is arrays
  assert pallas_block.head_arrays_for(arrays, []) is arrays
  prepared = pallas_block.head_arrays_for(arrays, [xla, hopper])
  assert set(prepared) == {"w1", "w2", "w2_parts"} and set(arrays) == {"w1", "w2"}
  assert prepared["w2"] is w2
  parts = np.asarray(prepared["w2_parts"], np.float32)
  assert parts.shape == (10, 64, 64)
  np.testing.assert_array_equal(parts[3, :, 5], np.asarray(w2[:, 3 * 64 + 5], np.float32))
  assert pallas_block.head_arrays_for(prepared, [hopper]) is prepared
  with pytest.raises(ValueError, match=r"^head_params: w2 must be \[r, V\]"):
    pallas_block.prepare_head_arrays({"w1": arrays["w1"], "w2": parts})
