"""The queue-driven decode (`decoding.queue`): each prompt's tokens equal decoding it alone, whichever
slot it lands in and whenever; the law through refills; no recompilation per prompt length; run
statistics; bad input. Tiny f32 models on the CPU."""

import json

import jax
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax import decoding
from dspark_jax.testing import law_checks
from tests import stats
from tests.test_decoding import _exact_first_three, make_draft, make_target

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [3], [2, 2, 2, 2, 2, 2, 2], [7, 1]]
TEMPERATURES = [0.0, 1.0, 0.7, 0.0, 1.3, 1.0]
SEEDS = [3, 4, 5, 6, 7, 8]
BUDGETS = [7, 3, 8, 1, 5, 6]   # rows finish at different rounds (and on the stop token)
STOP = 4


@pytest.fixture(scope="module")
def pair():
  target = make_target()
  return target, make_draft(target, 3, "vanilla")


def _queue(pair, spec, prompts=PROMPTS, **kw):
  target, draft = pair
  params = dj.SamplingParams(temperature=TEMPERATURES[:len(prompts)], seed=SEEDS[:len(prompts)])
  return dj.generate(target, draft if spec else None, prompts, params, jax.random.key(5),
                     max_new_tokens=BUDGETS[:len(prompts)], stop_token_ids=[STOP], spec=spec,
                     max_batch_size=2, **kw)


def _alone(pair, spec, i):
  target, draft = pair
  params = dj.SamplingParams(temperature=[TEMPERATURES[i]], seed=[SEEDS[i]])
  return dj.generate(target, draft if spec else None, [PROMPTS[i]], params, jax.random.key(5),
                     max_new_tokens=BUDGETS[i], stop_token_ids=[STOP], spec=spec)


@pytest.mark.parametrize("spec", [True, False])
def test_each_prompt_decodes_as_in_a_fixed_batch_whatever_its_slot(pair, spec):
  # 6 prompts (greedy and sampled rows, budgets 1..8, a stop token) through 2 slots: every prompt's
  # tokens, finish reason and counts equal the same prompts decoded as one fixed batch, whose rows
  # equal each prompt decoded alone (tests/test_decoding.py; every prompt alone:
  # `test_each_prompt_decodes_as_alone`).
  finished = []
  result = _queue(pair, spec, on_finish=lambda r: finished.append(r.index))
  target, draft = pair
  params = dj.SamplingParams(temperature=TEMPERATURES, seed=SEEDS)
  fixed = dj.generate(target, draft if spec else None, PROMPTS, params, jax.random.key(5),
                      max_new_tokens=BUDGETS, stop_token_ids=[STOP], spec=spec)
  np.testing.assert_array_equal(result.tokens, fixed.tokens)
  np.testing.assert_array_equal(result.lengths, fixed.lengths)
  assert result.finish_reason == fixed.finish_reason
  assert sorted(finished) == list(range(len(PROMPTS))) and finished != sorted(finished)
  assert {r.slot for r in result.results} == {0, 1}
  np.testing.assert_array_equal(result.row_rounds, fixed.row_rounds)
  np.testing.assert_array_equal(result.row_accepted, fixed.row_accepted)
  np.testing.assert_array_equal(result.reached, fixed.reached)
  np.testing.assert_array_equal(result.accepted, fixed.accepted)
  assert result.tau == pytest.approx(fixed.tau)
  assert 0 < result.occupancy <= 1 and result.slot_rounds == 2 * result.rounds
  assert 3 <= result.chunks <= result.rounds          # 6 prompts through 2 slots: 3 waves at least
  assert result.busy_slot_rounds >= result.row_rounds.sum()
  # While prompts wait, both slots are busy but for the iterations after a row's end in its chunk.
  assert 0 < result.queued_rounds < result.rounds and 1 <= result.saturated_rows <= 2
  for r in result.results:
    assert r.ttft_seconds >= 0 and r.seconds >= 0 and r.tokens.size == result.lengths[r.index]
  # The wall splits into refills, chunks and the host's work between them.
  assert result.refill_seconds > 0 and result.chunk_seconds > 0
  assert result.refill_seconds + result.chunk_seconds <= result.wall_seconds + 1e-9
  # The first refill fills the empty slots (before any round); the later ones replace rows.
  assert 0 < result.fill_seconds < result.refill_seconds
  assert result.host_seconds == pytest.approx(
      result.wall_seconds - result.refill_seconds - result.chunk_seconds)


@pytest.mark.parametrize("spec", [True, False])
def test_an_undrained_run_ends_when_saturation_ends(pair, spec):
  # drain=False (the steady-state measurement of bench_serving): the same 6 prompts through 2
  # slots end at the first boundary after the queue empties with a slot free. Every prompt was
  # admitted; those done equal the drained run's; the rest are "unfinished", their tokens a
  # strict prefix of the drained run's (or equal, at most: a row may reach its end in the same
  # chunk); at least one slot was still decoding, so the run has fewer rounds.
  target, draft = pair
  params = dj.SamplingParams(temperature=TEMPERATURES, seed=SEEDS)
  engine = dj.Engine(target, draft if spec else None, max_batch_size=2, spec=spec)
  full, cut = (engine.generate(PROMPTS, params, jax.random.key(5), max_new_tokens=BUDGETS,
                               stop_token_ids=[STOP], drain=drain) for drain in (True, False))
  reasons = cut.finish_reason
  assert "unfinished" in reasons and set(reasons) <= set(full.finish_reason) | {"unfinished"}
  assert cut.rounds < full.rounds
  for i, r in enumerate(cut.results):
    whole = full.results[i]
    if r.finish_reason == "unfinished":
      assert not cut.finished[i] and r.tokens.size <= whole.tokens.size
      np.testing.assert_array_equal(r.tokens, whole.tokens[:r.tokens.size])
    else:
      assert r.finish_reason == whole.finish_reason
      np.testing.assert_array_equal(r.tokens, whole.tokens)
  # The queue is not the limit until its last refill: every prompt ran, and those unfinished are
  # the ones in the slots at the end (at most S).
  assert all(r.slot in (0, 1) for r in cut.results) and reasons.count("unfinished") <= 2


@pytest.mark.slow
@pytest.mark.parametrize("spec", [True, False])
def test_each_prompt_decodes_as_alone(pair, spec):
  result = _queue(pair, spec)
  for i in range(len(PROMPTS)):
    alone = _alone(pair, spec, i)
    np.testing.assert_array_equal(result.results[i].tokens, alone.tokens[0, :alone.lengths[0]])
    assert result.results[i].finish_reason == alone.finish_reason[0]
    if spec:
      assert result.results[i].rounds == alone.row_rounds[0]
      np.testing.assert_array_equal(result.results[i].reached, alone.reached)


def test_refills_do_not_recompile_per_prompt_length(pair):
  # Three prompts through two slots (a refill of 2, then of 1), then three others of other lengths,
  # budgets and parameters in the same buckets (lengths <= 8): nothing compiles the second time.
  _queue(pair, True, prompts=PROMPTS[:3])
  programs = decoding.compiled_programs()
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compiles.append(name) if name.endswith("backend_compile_duration")
      else None)
  try:
    result = _queue(pair, True, prompts=[[5, 4, 3, 2, 1, 0, 9], [8], [2, 3, 4, 5]])
  finally:
    jax.monitoring.clear_event_listeners()
  assert compiles == [] and decoding.compiled_programs() == programs
  assert result.compile_seconds == 0.0


def test_law_through_refills():
  # N = 1,200 sampled prompts (T = 1, one prompt, distinct seeds) through 4 slots refilled two at a
  # time, budgets alternating 2 and 9 tokens so short rows are replaced while long ones decode;
  # V = 8, γ = 3. Statistic: Pearson chi-square of the first two generated tokens (64 outcomes)
  # against the target's exact law; threshold p >= 1e-3. Power: the law at T = 0.6 is rejected at
  # p < 1e-6.
  target = make_target(vocab=8, sharpness=6.0, seed=3)
  draft = make_draft(target, 3, "vanilla", copy_bias=2.0, seed=4)
  n, prompt = 1200, [1, 5, 2]
  params = dj.SamplingParams(temperature=np.ones(n), seed=np.arange(n))
  engine = dj.Engine(target, draft, max_batch_size=4, refill_at=2)
  result = engine.generate([prompt] * n, params, jax.random.key(11),
                           max_new_tokens=np.where(np.arange(n) % 2, 9, 2))
  assert result.path == "folded-sampling" and result.rounds > n // 4
  counts = law_checks.outcome_counts(result.tokens[:, :2], 8)[:8, :8]
  stats.assert_law(counts, _exact_first_three(target, prompt, 1.0).sum(2),
                   what="queue, first two tokens")
  stats.assert_rejects(counts, _exact_first_three(target, prompt, 0.6).sum(2),
                       what="wrong temperature")


@pytest.mark.parametrize("edit,match", [
    (dict(prompts=[]), "prompts: the queue is empty"),
    (dict(max_batch_size=0), "max_batch_size: must be an integer >= 1, got 0"),
    (dict(max_seq_len=8), "prompts: prompt 1 has 5 tokens and max_new_tokens 4, 9 in all"),
    (dict(prompts=[[1], [2, 12]]), "prompts: row 1 token 1 is 12"),
    (dict(trace=True, spec=False), "trace: only speculative decoding"),
    (dict(max_batch_size=None, on_finish=print), "on_finish: only the queue-driven decode"),
    (dict(max_batch_size=None, kv="paged"), "kv: only the queue-driven decode"),
    (dict(kv="pages"), "kv: expected one of"),
    (dict(num_pages=4), "num_pages: only a paged cache has a pool"),
    (dict(kv="paged", page_size=16, num_pages=1), "num_pages: a pool of 1 pages of 16"),
    (dict(kv="paged", page_size=16, num_pages=1, prompts=[[1, 2], [3] * 17]),
     "prompts: prompt 1 has 17 tokens, more than the pool of num_pages=1 pages"),
])
def test_bad_queue_inputs_raise_clear_errors(pair, edit, match):
  target, draft = pair
  args = dict(target=target, draft=draft, prompts=[[1, 2], [1, 2, 3, 4, 5]],
              params=dj.SamplingParams(temperature=0.0, batch_size=2), key=jax.random.key(0),
              max_new_tokens=4, max_batch_size=1)
  args.update(edit)
  with pytest.raises(ValueError, match=match):
    dj.generate(**args)


def test_eval_appends_each_prompt_and_resumes(pair, tmp_path):
  # The eval's queue (`evaluation._decode_queue`) appends each finished prompt to a JSON-lines
  # file; after an interruption (the last two records lost) a rerun decodes only the two missing
  # prompts and pools the same counts as the uninterrupted run.
  from tqdm.auto import tqdm

  from dspark_jax.apps import evaluation
  target, draft = pair
  path = str(tmp_path / "results.jsonl")
  run = lambda file: evaluation._decode_queue(target, PROMPTS[:4], 2, 1.0, 3, 8, [STOP],
                                              tqdm(disable=True), draft, results=file, name="d")
  whole = run(evaluation.ResultFile(path))
  lines = open(path).read().splitlines()
  assert sorted(json.loads(line)["prompt"] for line in lines) == [0, 1, 2, 3]
  open(path, "w").write("\n".join(lines[:2]) + "\n{\"drafter\": \"d\", \"temp")  # a cut line
  resumed = run(evaluation.ResultFile(path))
  assert resumed.tokens == sum(json.loads(line)["tokens"].__len__() for line in lines[2:])
  assert sorted(json.loads(line)["prompt"] for line in open(path).read().splitlines()[:2] +
                open(path).read().splitlines()[3:]) == [0, 1, 2, 3]
  np.testing.assert_array_equal(resumed.reached, whole.reached)
  np.testing.assert_array_equal(resumed.accepted, whole.accepted)
  assert resumed.tau == pytest.approx(whole.tau)


def test_paged_queue_preempts_and_each_prompt_decodes_as_in_a_fixed_batch(pair):
  # 6 prompts (greedy and sampled rows, a stop token) through 2 slots over a pool of 2 pages of 16
  # positions (one slot's capacity), growing by a lookahead of one round: rows are admitted by free
  # pages and the newest is preempted when the oldest grows into a second page, then recomputed
  # from its prompt and committed tokens. Every prompt's tokens and counts equal the fixed batch
  # (whose rows equal decoding alone, tests/test_decoding.py), preempted sampled rows included;
  # the queue prefills in passes of 4 positions (a resumed row's prompt and tokens too), the fixed
  # batch in one pass.
  target, draft = pair
  params = dj.SamplingParams(temperature=TEMPERATURES, seed=SEEDS)
  budgets = [8] * len(PROMPTS)
  engine = dj.Engine(target, draft, max_batch_size=2, rounds_per_call=1, kv="paged",
                     page_size=16, num_pages=2, prefill_chunk=4)
  result = engine.generate(PROMPTS, params, jax.random.key(5), max_new_tokens=budgets,
                           stop_token_ids=[STOP])
  fixed = dj.generate(target, draft, PROMPTS, params, jax.random.key(5), max_new_tokens=budgets,
                      stop_token_ids=[STOP])
  np.testing.assert_array_equal(result.tokens, fixed.tokens)
  np.testing.assert_array_equal(result.lengths, fixed.lengths)
  assert result.finish_reason == fixed.finish_reason
  np.testing.assert_array_equal(result.row_rounds, fixed.row_rounds)
  np.testing.assert_array_equal(result.row_accepted, fixed.row_accepted)
  np.testing.assert_array_equal(result.reached, fixed.reached)
  assert result.kv == "paged" and (result.num_pages, result.page_size) == (2, 16)
  preempted = [r.index for r in result.results if r.preempted]
  assert result.preemptions >= 1 and any(TEMPERATURES[i] > 0 for i in preempted)
  assert 0 < result.pages_mean <= result.pages_peak <= 2
  assert 1 <= result.saturated_rows <= 2   # the pool holds one slot's capacity, rows grow in it
  # Other prompt lengths and budgets in the same buckets compile nothing more.
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compiles.append(name) if name.endswith("backend_compile_duration")
      else None)
  try:
    again = engine.generate([[5, 4, 3], [8], [2, 3, 4, 5]],
                            dj.SamplingParams(temperature=TEMPERATURES[:3], seed=SEEDS[:3]),
                            jax.random.key(5), max_new_tokens=[2, 3, 1], stop_token_ids=[STOP])
  finally:
    jax.monitoring.clear_event_listeners()
  assert compiles == [] and again.compile_seconds == 0.0 and again.preemptions == 0


@pytest.mark.slow
def test_paged_autoregressive_queue_preempts_and_decodes_as_in_a_fixed_batch(pair):
  # The baseline loop over a pool of 2 pages of 16 (one slot's capacity): prompts of 10..14 tokens
  # start in one page each and outgrow it together, so the newest is preempted and recomputed.
  target, _ = pair
  prompts = [[(i * 5 + j) % 11 + 1 for j in range(n)] for i, n in enumerate([12, 14, 13, 10])]
  params = dj.SamplingParams(temperature=[1.0, 0.0, 0.8, 1.2], seed=[1, 2, 3, 4])
  result = dj.Engine(target, None, max_batch_size=2, spec=False, rounds_per_call=1, kv="paged",
                     page_size=16, num_pages=2).generate(prompts, params, jax.random.key(2),
                                                         max_new_tokens=8)
  fixed = dj.generate(target, None, prompts, params, jax.random.key(2), max_new_tokens=8,
                      spec=False)
  np.testing.assert_array_equal(result.tokens, fixed.tokens)
  assert result.finish_reason == fixed.finish_reason and result.preemptions >= 1


def test_paged_pool_is_sized_from_free_memory_less_buffers_at_most_every_slot_full(pair):
  # Free memory of 5.5 pages (target + draft context, every layer) past four float32 [S, γ+1, V]
  # buffers gives 5 pages; plenty gives S slots of max_pages; unknown free memory gives the same.
  from dspark_jax.paging import allocator
  target, draft = pair
  t, d = target.config, draft
  size = lambda dtype: np.dtype(dtype).itemsize
  per_token = (allocator.token_bytes(t.num_layers, t.layer.num_kv_heads, t.layer.head_dim,
                                     size(t.dtype))
               + allocator.token_bytes(len(d.layers), d.shape.num_kv_heads, d.shape.head_dim,
                                       size(d.config.dtype)))
  page_bytes, buffers = 16 * per_token, 4 * 4 * (d.config.gamma + 1) * t.vocab_size * 4
  pool = lambda limit: dj.Engine(target, draft, 4, kv="paged", page_size=16, headroom_bytes=0,
                                 memory_stats=None if limit is None else
                                 {"bytes_limit": limit, "bytes_in_use": 0})._pool(4, 3)
  assert pool(buffers + 5 * page_bytes + page_bytes // 2) == 5
  assert pool(10 ** 12) == 12 and pool(None) == 12


def test_paged_queue_allocates_no_contiguous_caches(pair, monkeypatch):
  # The empty loop state of a paged queue holds no [S, cache_len] caches beside its page pool (on
  # an H100 they took the memory the pool was sized into, and the pool's allocation thrashed).
  from dspark_jax.decoding import queue, slots
  made = []

  def spy(*args, **kwargs):
    state = slots._empty_state(*args, **kwargs)
    made.append(set(state))
    return state
  monkeypatch.setattr(queue, "_empty_state", spy)
  target, draft = pair
  params = dj.SamplingParams(temperature=np.zeros(2))
  for kv in ("paged", "contiguous"):
    dj.Engine(target, draft, 2, kv=kv, page_size=16).generate(
        [[1, 2, 3], [4, 5]], params, jax.random.key(0), max_new_tokens=4)
  assert not made[0] & set(slots.CACHE_KEYS) and set(slots.CACHE_KEYS) <= made[1]


def test_an_engine_traces_its_empty_state_once_per_shape(pair, monkeypatch):
  # The empty loop state's shapes come from tracing the prefill (a second or more of the host's
  # time on a deep model): an engine traces them once per shape, and its later runs with the
  # same shapes decode the same tokens from the remembered ones.
  from dspark_jax.decoding import slots
  traced = []
  real = jax.eval_shape

  def counting(fn, *args, **kwargs):
    traced.append(fn)
    return real(fn, *args, **kwargs)
  monkeypatch.setattr(slots.jax, "eval_shape", counting)
  target, draft = pair
  params = dj.SamplingParams(temperature=[0.0, 1.0], seed=[1, 2])
  engine = dj.Engine(target, draft, 2, max_seq_len=24)
  run = lambda prompts: engine.generate(prompts, params, jax.random.key(3), max_new_tokens=6)
  first, second = run([[1, 2, 3], [4, 5]]), run([[1, 2, 3], [4, 5]])
  assert len(traced) == 1
  np.testing.assert_array_equal(first.tokens, second.tokens)
  run([[6, 7], [8, 9, 1, 2]])                 # other prompts, the same shapes
  assert len(traced) == 1
  dj.Engine(target, draft, 2, max_seq_len=40).generate(   # another engine, other slot lengths
      [[1, 2, 3], [4, 5]], params, jax.random.key(3), max_new_tokens=6)
  assert len(traced) == 2


@pytest.mark.parametrize("paged", [False, True])
def test_out_of_device_memory_names_the_concurrency_and_cache(pair, monkeypatch, paged):
  # An XLA RESOURCE_EXHAUSTED error from a program (simulated: nothing is allocated) comes back
  # naming the slots, the cache size per slot and what to lower.
  def exhausted(*args):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes")

  monkeypatch.setattr(decoding.compile_cache, "compiled", lambda *args, **kw: (exhausted, 0.0))
  if paged:
    match = (r"max_batch_size=2 slots over a pool of 6 pages of 16 positions.*lower num_pages "
             r"\(pool size\) or max_batch_size \(concurrency\)")
    kw = dict(kv="paged", num_pages=6, page_size=16)
  else:
    match = r"max_batch_size=2 slots of \d+ cache positions each.*lower max_batch_size \(concurrency\)"
    kw = {}
  with pytest.raises(RuntimeError, match=match):
    _queue(pair, True, prompts=PROMPTS[:3], **kw)


def test_a_refill_pads_its_prompts_to_whole_prefill_passes():
  # T = the power-of-two bucket of the longest prompt (at least 8, at most the slot's capacity);
  # where that is over `chunk`, the most whole passes of `chunk` the capacity holds (one program
  # per K, one pass body), or the capacity itself when the longest reaches past them. Each row
  # keeps its own tokens and length.
  from dspark_jax.decoding import slots
  lens = np.array([3, 9, 33])
  padded = np.zeros((3, 40), np.int32)
  for i, n in enumerate(lens):
    padded[i, :n] = np.arange(1, n + 1)
  for rows, cache_len, chunk, width in (([0], 100, None, 8), ([0], 100, 8, 8), ([0], 100, 4, 100),
                                        ([1], 100, 12, 96), ([0, 1], 100, 16, 16),
                                        ([2], 40, 12, 36), ([2], 34, 12, 34), ([2], 100, 512, 64)):
    group, group_lens = slots._group_prompts(padded, lens, np.array(rows), {}, cache_len, chunk)
    assert group.shape == (len(rows), width), (rows, cache_len, chunk)
    np.testing.assert_array_equal(group_lens, lens[rows])
    for r, i in enumerate(rows):
      np.testing.assert_array_equal(group[r, :lens[i]], padded[i, :lens[i]])
      assert not group[r, lens[i]:].any()


def test_refills_of_a_fixed_row_count_decode_the_same_tokens_in_one_program(pair):
  # refill_rows=2 over 4 slots: the first boundary admits 4 prompts as two refills of 2, later
  # ones 1 or 2 (padded to 2). Every prompt's tokens and counts equal the fixed batch's (rows'
  # draws depend on (key, seed, position) only, not on which refill took them), and the engine
  # compiled one refill program (the prompts share one length bucket).
  from dspark_jax.decoding import compile_cache
  target, draft = pair
  params = dj.SamplingParams(temperature=TEMPERATURES, seed=SEEDS)
  engine = dj.Engine(target, draft, max_batch_size=4, refill_rows=2, rounds_per_call=2)
  logged = len(compile_cache.compile_log())
  result = engine.generate(PROMPTS, params, jax.random.key(5), max_new_tokens=BUDGETS,
                           stop_token_ids=[STOP])
  refills = [n for n, _ in compile_cache.compile_log()[logged:] if "refill" in n]
  fixed = dj.generate(target, draft, PROMPTS, params, jax.random.key(5), max_new_tokens=BUDGETS,
                      stop_token_ids=[STOP])
  np.testing.assert_array_equal(result.tokens, fixed.tokens)
  np.testing.assert_array_equal(result.row_accepted, fixed.row_accepted)
  assert result.finish_reason == fixed.finish_reason
  assert len(refills) <= 1 and 0 < result.fill_seconds < result.refill_seconds
  for bad, match in ((0, "^refill_rows: must be an integer >= 1"),
                     (5, "^refill_rows: 5 is more than the 4 slots")):
    with pytest.raises(ValueError, match=match):
      dj.Engine(target, draft, max_batch_size=4, refill_rows=bad)


def test_refill_at_auto_waits_for_a_32nd_of_the_slots(pair):
  # The default refill_at="auto" is S // 32 free slots (at least 1); an int is taken as given; a
  # string other than "auto" or a count below 1 is refused by name.
  from dspark_jax.decoding import queue
  target, draft = pair
  assert [queue.auto_refill_at(s) for s in (1, 31, 32, 64, 256)] == [1, 1, 1, 2, 8]
  assert dj.Engine(target, draft, max_batch_size=64).refill_at == 2
  assert dj.Engine(target, draft, max_batch_size=4).refill_at == 1
  assert dj.Engine(target, draft, max_batch_size=64, refill_at=3).refill_at == 3
  for bad, match in (("half", "^refill_at: must be an integer >= 1 or 'auto', got 'half'"),
                     (0, "^refill_at: must be an integer >= 1, got 0")):
    with pytest.raises(ValueError, match=match):
      dj.Engine(target, draft, max_batch_size=4, refill_at=bad)


def test_warm_up_runs_every_refill_program_so_a_run_compiles_nothing(pair, monkeypatch):
  # Refills of 2 rows (one or two prompts of 100..300 tokens) pack into 256, 512 or 768 tokens:
  # three refill programs, which `warm_up` runs once each (with the chunk program). A run of 9
  # prompts of random lengths in that range, random budgets, through 4 paged slots then compiles
  # nothing.
  target, draft = pair
  engine = dj.Engine(target, draft, max_batch_size=4, max_seq_len=320, refill_rows=2,
                     rounds_per_call=2, kv="paged")
  # Compiled side by side on 3 threads (`compile_cache.compiling_ahead`), then run in turn.
  monkeypatch.setattr(decoding.compile_cache, "_COMPILED", {})
  monkeypatch.setattr(decoding.compile_cache, "_LOG", [])
  assert engine.warm_up((100, 300), stop_token_ids=[STOP], compile_workers=3) == 3
  assert sorted(name for name, _ in decoding.compile_cache.compile_log()) == [
      "_chunk_program"] + ["_refill_program"] * 3
  programs = decoding.compiled_programs()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, STOP, n).tolist() for n in rng.integers(100, 301, 9)]
  params = dj.SamplingParams(temperature=np.zeros(9), seed=np.arange(9))
  result = engine.generate(prompts, params, jax.random.key(0),
                           max_new_tokens=rng.integers(1, 12, 9), stop_token_ids=[STOP])
  assert decoding.compiled_programs() == programs and result.compile_seconds == 0.0
  engine.warm_up((100, 300), sampled=True, stop_token_ids=[STOP],   # the sampling chunk
                 compile_workers=1)
  programs = decoding.compiled_programs()
  params = dj.SamplingParams(temperature=np.linspace(0.0, 1.0, 9), seed=np.arange(9))
  result = engine.generate(prompts, params, jax.random.key(0), max_new_tokens=5,
                           stop_token_ids=[STOP])
  assert decoding.compiled_programs() == programs and result.compile_seconds == 0.0
  with pytest.raises(ValueError, match=r"^compile_workers: must be an integer >= 1, got 0"):
    engine.warm_up((100, 300), compile_workers=0)
  for bad, match in (((0, 300), r"prompt_lengths: need 1 <= LO <= HI < max_seq_len=320"),
                     ((200, 100), r"got \(200, 100\)"), ((1, 320), r"got \(1, 320\)"),
                     ("long", r"prompt_lengths: expected \(LO, HI\), got 'long'")):
    with pytest.raises(ValueError, match=match):
      engine.warm_up(bad)
  for unset in ("max_seq_len", "refill_rows"):
    kw = dict(max_seq_len=320, refill_rows=2)
    kw.pop(unset)
    with pytest.raises(ValueError, match=f"^warm_up: {unset} is None"):
      dj.Engine(target, draft, max_batch_size=4, **kw).warm_up((1, 8))


@pytest.mark.parametrize("low,high,rows,pack,packs_up_to,chunk,cache_len",
                         [(50, 700, 3, True, 1024, None, 2048), (10, 300, 4, False, 0, 64, 512),
                          (100, 100, 3, True, 4096, None, 512), (1, 400, 3, True, 512, 128, 512)])
def test_warm_up_groups_meet_every_refill_program(low, high, rows, pack, packs_up_to, chunk,
                                                  cache_len):
  """Every refill program (`slots.refill_form`: packed size or padded width) that a refill of
  `rows` rows of prompts of low..high tokens can meet, enumerated over every (prompt count,
  longest, total), has one warm-up group, and every group is such a refill. The packed attention
  runs up to `packs_up_to` tokens here, so large refills pad."""
  from dspark_jax.decoding import slots
  form = lambda lengths: slots.refill_form(lengths, rows, pack=pack,
                                           packs=lambda n: n <= packs_up_to,
                                           cache_len=cache_len, chunk=chunk)
  reachable = set()
  for real in range(1, rows + 1):
    for longest in range(low, high + 1):
      for total in range(longest + (real - 1) * low, real * longest + 1):
        others, extra = divmod(total - longest, real - 1) if real > 1 else (0, 0)
        reachable.add(form([longest] + [others + (i < extra) for i in range(real - 1)]))
  groups = slots.warm_up_groups(low, high, rows, form)
  assert {form(g) for g in groups} == reachable and len(groups) == len(reachable)
  assert all(1 <= len(g) <= rows and low <= min(g) and max(g) <= high for g in groups)
