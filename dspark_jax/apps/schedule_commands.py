"""The schedule study's subcommands: ``dspark-jax eval --schedule`` (`evaluate_schedules`) and
``dspark-jax calibrate`` (`calibrate`).

Each reads its parsed flags (`dspark_jax.apps.cli` describes them), runs the study
(`dspark_jax.apps.schedule_study`, `dspark_jax.apps.calibration_study`), prints a markdown table or
the JSON document, and writes the JSON and the figures (`dspark_jax.apps.study_figures`). A flag
that parsed but cannot be used exits naming it (`flags.fail`).
"""

from __future__ import annotations

import sys

from dspark_jax.apps import flags


def _pair_and_prompts(args, command: str, *, first: int):
  """(target, draft, prompt ids, stop ids, name, about) for the schedule study and calibrate: the
  shipped pair's held-out prompts without ``--target``/``--dataset``, else the dataset's prompts
  (``--prompts`` of them from ``--first-prompt``); exits naming the flag."""
  from dspark_jax.apps import evaluation

  if args.target is None and args.dataset is None:
    from dspark_jax.formats import shipped
    for flag in ("draft", "tokenizer", "dtype"):
      if getattr(args, flag) is not None:
        flags.fail(command, f"--{flag}", "needs --target (without it the shipped pair runs)")
    if args.chat:
      flags.fail(command, "--chat", "needs --dataset (the shipped prompts are held-out code)")
    if args.chat_kwargs is not None:
      flags.fail(command, "--chat-kwargs", "needs --chat")
    pair = shipped.load_shipped()
    texts = pair.prompts[first:first + args.prompts if args.prompts else None]
    if not texts:
      flags.fail(command, "--first-prompt",
                 f"{first}: the shipped pair has {len(pair.prompts)} held-out prompts")
    ids = [pair.encode(t) for t in texts]
    about = {"prompts_from": "shipped held-out", "first_prompt": first, "prompts": len(ids)}
    return pair.target, pair.draft, ids, list(pair.tokenizer.stop_token_ids), "shipped pair", about
  if args.dataset is None:
    flags.fail(command, "--dataset", "required with --target")
  try:
    texts = evaluation.read_eval_dataset(args.dataset, first + args.prompts if args.prompts
                                         else None)[first:]
  except ValueError as error:
    flags.fail(command, "--dataset", str(error))
  if not texts:
    flags.fail(command, "--first-prompt", f"{first}: {args.dataset} has no prompts from there")
  target, draft, tokenizer, name = flags.load_models(args, command, need_draft=True)
  from dspark_jax.text import generation
  try:
    ids = generation.encode_prompts(tokenizer, texts, chat=args.chat, chat_kwargs=args.chat_kwargs)
  except ValueError as error:
    flags.fail(command, "--dataset", str(error))
  stop_ids = [i for i in tokenizer.stop_token_ids if i < target.config.vocab_size]
  about = {"target": args.target, "draft": args.draft, "dataset": args.dataset,
           "first_prompt": first, "prompts": len(ids), "chat": args.chat}
  return target, draft, ids, stop_ids, name, about


def _device() -> str:
  import jax
  device = jax.devices()[0]
  kind = device.device_kind
  return device.platform if kind.lower() == device.platform else f"{device.platform}: {kind}"


def evaluate_schedules(args) -> int:
  """``eval --schedule``: the schedule study (flags and outputs: `dspark_jax.apps.cli`)."""
  import json
  import os

  import numpy as np

  from dspark_jax.apps import calibration_study
  from dspark_jax.apps import schedule_study
  from dspark_jax.apps import study_figures
  from dspark_jax.scheduling import schedules

  specs = args.schedule
  needs_sps = [s.label for s in specs if s.needs_sps]
  sps, sps_about = None, None
  if args.sps is not None:
    if not needs_sps:
      flags.fail("eval", "--sps", "no schedule in --schedule reads a table (prefix and top_k do)")
    if not os.path.isfile(args.sps):
      flags.fail("eval", "--sps", f"{args.sps}: no such file")
    try:
      sps = schedules.load_sps(args.sps)
      with open(args.sps, encoding="utf-8") as f:
        meta = json.load(f)
    except (ValueError, OSError) as error:
      flags.fail("eval", "--sps", str(error))
    sps_about = {"source": args.sps, "device": meta.get("device"), "date": meta.get("date")}
  temperatures_file = None
  if args.calibration is not None:
    try:
      temperatures_file = calibration_study.load_temperatures(args.calibration)
    except ValueError as error:
      flags.fail("eval", "--calibration", str(error))
  held_out = args.dataset is None
  target, draft, ids, stop_ids, name, about = _pair_and_prompts(args, "eval", first=args.first_prompt)
  reads_confidence = [s.label for s in specs if s.kind != "fixed"]
  if reads_confidence and draft.confidence is None:
    flags.fail("eval", "--draft",
               f"has no confidence head, which {', '.join(reads_confidence)} read")
  if temperatures_file is not None:
    try:
      draft = calibration_study.with_temperatures(draft, temperatures_file)
    except ValueError as error:
      flags.fail("eval", "--calibration", str(error))
  concurrency = args.concurrency or 8
  temperatures = args.temperatures or ([0.0, 1.0] if held_out else [1.0])
  max_new_tokens = args.max_new_tokens or (128 if held_out else 2048)
  os.makedirs(args.out, exist_ok=True)
  gamma = draft.config.gamma
  largest = max([concurrency] + list(args.throughput_batches or []))
  if needs_sps and sps is None:
    context = int(round(np.mean([len(p) for p in ids]) + max_new_tokens / 2))
    path = os.path.join(args.out, "sps.json")
    print(f"measuring the throughput table on {_device()} (profile_sps, context {context}, up to "
          f"{largest} rows of {gamma + 1} tokens) ...", file=sys.stderr)
    profile = schedule_study.measure_sps(target, draft, max_batch=largest, context=context,
                                         path=path)
    sps = schedules.dense_sps(profile.batch_tokens, profile.steps_per_second)
    sps_about = {"source": "measured now with profile_sps", "path": path,
                 "device": profile.device, "date": profile.date, "context": context}
  notes = []
  if sps is not None and len(sps) - 1 < largest * (gamma + 1):
    notes.append(f"the throughput table ends at {len(sps) - 1} batch tokens, below {largest} rows "
                 f"x {gamma + 1}: prefix/top_k admit nothing past it")
  notes += [f"{s.label} is the anticipating search: NOT lossless (shown for comparison)"
            for s in specs if not s.lossless]
  try:
    rows = schedule_study.compare_schedules(
        target, draft, ids, specs, sps=sps, temperatures=temperatures, concurrency=concurrency,
        max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, seed=args.seed,
        progress=not args.json)
    throughput = []
    if args.throughput_batches:
      throughput = schedule_study.throughput_sweep(
          target, draft, ids, specs, args.throughput_batches, sps=sps,
          temperature=temperatures[0], max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
          seed=args.seed, progress=not args.json)
  except ValueError as error:
    raise SystemExit(f"dspark-jax eval: error: {error}") from None
  document = {"pair": name, **about, "device": _device(), "concurrency": concurrency,
              "max_new_tokens": max_new_tokens, "temperatures": temperatures, "seed": args.seed,
              "schedules": [s.label for s in specs], "sps": sps_about,
              "calibration": None if args.calibration is None else {
                  "path": args.calibration, "temperatures": temperatures_file.tolist()},
              "notes": notes, "rows": [row.as_dict() for row in rows],
              "throughput": [row.as_dict() for row in throughput]}
  data = os.path.join(args.out, "schedules.json")
  plot = None
  if throughput:
    plot = study_figures.plot_throughput(throughput, os.path.join(args.out, "throughput.png"),
                                         sps=sps)
    document["throughput_plot"] = plot
  with open(data, "w") as f:
    json.dump(document, f, indent=1)
  if args.json:
    print(json.dumps(document, indent=1))
    return 0
  print(f"{name}: {len(ids)} prompts, concurrency {concurrency}, max {max_new_tokens} new tokens, "
        f"on {_device()}")
  if sps_about is not None:
    print(f"throughput table: {sps_about['source']} (device {sps_about['device']}, "
          f"{sps_about['date']})")
  if args.calibration is not None:
    print(f"confidence temperatures from {args.calibration}: "
          + " ".join(f"{t:.3g}" for t in temperatures_file))
  print(schedule_study.format_schedule_table(rows))
  if throughput:
    print(f"tokens/s by concurrency (T = {temperatures[0]:g}):")
    print(schedule_study.format_schedule_table(throughput))
  for note in notes:
    print(f"note: {note}")
  print(f"data: {data}" + (f"; plot: {plot}" if plot else ""))
  return 0


def calibrate(args) -> int:
  """``calibrate``: STS temperatures of the draft's confidence head (flags and outputs:
  `dspark_jax.apps.cli`)."""
  import json
  import os

  from dspark_jax.apps import calibration_study
  from dspark_jax.apps import study_figures

  if args.save_draft is not None and args.target is None:
    flags.fail("calibrate", "--save-draft",
               "needs --target and --draft (the shipped pair is read from the package: pass "
               "--out's file to eval --calibration)")
  folder = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(folder):
    flags.fail("calibrate", "--out", f"{folder} is not a directory")
  flags.concurrency_alias(args, "calibrate")
  concurrency = args.concurrency or 8
  held_out = args.dataset is None
  first = args.first_prompt if args.first_prompt is not None else (42 if held_out else 0)
  target, draft, ids, stop_ids, name, about = _pair_and_prompts(args, "calibrate", first=first)
  if draft.confidence is None:
    flags.fail("calibrate", "--draft", "has no confidence head (nothing to calibrate)")
  previous = draft.confidence.temperatures
  temperatures = args.temperatures or ([0.0, 1.0] if held_out else [1.0])
  max_new_tokens = args.max_new_tokens or (128 if held_out else 512)
  try:
    result = calibration_study.calibrate(
        target, draft, ids, temperatures=temperatures, concurrency=concurrency,
        max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, seed=args.seed, bins=args.bins)
  except ValueError as error:
    raise SystemExit(f"dspark-jax calibrate: error: {error}") from None
  meta = {"pair": name, **about, "device": _device(), "sampling_temperatures": temperatures,
          "max_new_tokens": max_new_tokens, "concurrency": concurrency, "seed": args.seed,
          "grid": "41 log-spaced temperatures in [0.1, 10] (calibration.DEFAULT_GRID)",
          "replaced_temperatures": None if previous is None else
          [float(t) for t in previous[...].tolist()]}
  calibration_study.save_calibration(args.out, result, meta)
  plot = study_figures.plot_reliability(
      result, args.plot or os.path.splitext(args.out)[0] + "_reliability.png")
  saved = None
  if args.save_draft is not None:
    import dspark_jax
    try:
      dspark_jax.save_pretrained(calibration_study.with_temperatures(draft, result.temperatures),
                                 args.save_draft, target=target)
    except (ValueError, OSError) as error:
      flags.fail("calibrate", "--save-draft", str(error))
    saved = args.save_draft
  if args.json:
    print(json.dumps({**result.as_dict(), **meta, "plot": plot, "saved_draft": saved}, indent=1))
    return 0
  print(f"{name}: {len(ids)} calibration prompts from {first}, T = "
        f"{','.join(f'{t:g}' for t in temperatures)}, max {max_new_tokens} new tokens; "
        f"{result.rounds} rounds verified every position")
  if previous is not None:
    print("the draft's own temperatures were set aside: the fit starts from the raw head")
  print(calibration_study.format_calibration_table(result))
  print(f"temperatures: {args.out}; reliability diagram: {plot}"
        + (f"; calibrated draft: {saved}" if saved else ""))
  return 0
