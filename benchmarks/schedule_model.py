"""The schedules under the cost model: modelled tokens/s of each schedule on a measured round table.

For a concurrency c, a round table {N: rounds/s} (whole decoding rounds of c rows at N packed
verify tokens, `dj.profile_sps(..., draft_cost=True)`; a bucket slower than a larger one packs into
the larger, as `SpsProfile.dense` does) and the synthetic acceptance law (`benchmarks.synthetic`:
rates c_1..c_γ, rows spread by σ), each schedule decides on ``--rounds`` rounds of c rows whose
confidences are the law's (a perfectly calibrated head; with σ > 0 each round draws fresh rows, a
normal z per row and draft). A round's modelled tokens/s is Σ_r (1 + Σ_{k ≤ ℓ_r} a_{r,k}) · sps(N):
the expected accepted drafts plus the bonus of every row, times the table's rate at the round's
tokens. Reported: the mean over rounds for plain full verification (`fixed`), `prefix`, `top_k`
(lag 2) and the best single verify length for every row (`uniform ℓ*`), and each over `fixed`;
and an *oracle* bound no schedule can pass: each row verifies exactly its accepted run and the
bonus (a clairvoyant length, drawn from the law with a fixed seed), so every verified token is
kept and the round costs sps(Σ_r (accepted_r + 1)).

No device: it reads tables measured elsewhere. The default tables are the H100's of 2026-12-06
(Qwen3-4B shape, bf16, context ~640, from `bench_serving`'s throughput study).

  python -m benchmarks.schedule_model                        # the H100 tables, σ = 0, 1, 2, 3
  python -m benchmarks.schedule_model --spread 2 --table 64:64=120,128=110,256=95,512=70
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks import synthetic
from dspark_jax.scheduling import schedules

H100_TABLES = {
    256: {256: 43.19, 512: 37.80, 768: 33.28, 1024: 29.74, 1536: 24.33, 2048: 23.81},
    128: {128: 69.62, 256: 65.51, 384: 59.91, 512: 54.14, 768: 44.95, 1024: 45.24},
}
"""Rounds/s per verify bucket measured on an NVIDIA H100 80GB HBM3, 2026-12-06 (bench_serving)."""


def parse_table(text: str) -> tuple[int, dict[int, float]]:
  """'c:N=rate,N=rate,...' -> (c, {N: rate})."""
  head, _, body = text.partition(":")
  pairs = [item.split("=") for item in body.split(",") if item]
  return int(head), {int(n): float(r) for n, r in pairs}


def dense_table(table: dict[int, float]) -> np.ndarray:
  """float32 [max N + 1]: sps[n] = the best rate of any bucket holding n tokens (sps[0] = 0)."""
  sizes = np.array(sorted(table))
  rates = np.array([table[s] for s in sizes])
  out = np.zeros(sizes[-1] + 1, np.float32)
  for n in range(1, sizes[-1] + 1):
    out[n] = rates[sizes >= n].max()
  return out


def modelled(schedule, confidences: list[np.ndarray], sps: np.ndarray) -> float:
  """Mean modelled tokens/s of `schedule` over rounds of [c, γ] confidences."""
  batch, gamma = confidences[0].shape
  state = schedule.init(batch, gamma)
  values = []
  for conf in confidences:
    lens, state = schedule.update(jnp.asarray(conf), jnp.ones(batch, bool), state)
    lens = np.asarray(lens)
    survival = np.cumprod(conf.astype(np.float64), axis=1)
    verified = np.arange(gamma)[None, :] < (lens - 1)[:, None]
    tau = float(np.sum(1 + np.sum(np.where(verified, survival, 0.0), axis=1)))
    values.append(tau * float(sps[min(int(lens.sum()), sps.shape[0] - 1)]))
  return float(np.mean(values))


def oracle(confidences: list[np.ndarray], sps: np.ndarray, seed: int) -> float:
  """Mean tokens/s of a clairvoyant schedule: each row's accepted run drawn from its confidences
  (draft k accepted with probability c_k given drafts < k accepted), verified exactly with its
  bonus, at the table's rate for those tokens."""
  rng = np.random.default_rng(seed)
  values = []
  for conf in confidences:
    accepted = np.cumprod(rng.random(conf.shape) < conf, axis=1).sum(axis=1)
    tokens = int(np.sum(accepted + 1))
    values.append(tokens * float(sps[min(tokens, sps.shape[0] - 1)]))
  return float(np.mean(values))


def rounds_of(rates, spread: float, batch: int, count: int, seed: int) -> list[np.ndarray]:
  """`count` rounds of [batch, γ] float32 confidences: the law's rates, each round's rows spread
  by fresh normals (σ = `spread`)."""
  rng = np.random.default_rng(seed)
  law = np.asarray(rates, np.float64)
  logit = np.log(law) - np.log1p(-law)
  return [(1 / (1 + np.exp(-(logit[None] + spread * rng.normal(size=(batch, law.size)))))
           ).astype(np.float32) for _ in range(count)]


def study(c: int, table: dict[int, float], rates, spread: float, count: int, seed: int) -> dict:
  sps = dense_table(table)
  rounds = rounds_of(rates, spread, c, count, seed)
  out = {name: modelled(schedule, rounds, sps) for name, schedule in (
      ("fixed", schedules.fixed()), ("prefix", schedules.prefix(sps)),
      ("top_k", schedules.top_k(sps, lag=2)))}
  gamma = len(rates)
  uniform = {l: modelled(schedules.Schedule(
      schedules.fixed().init, lambda conf, active, state, l=l: (
          jnp.full(conf.shape[:1], l + 1, jnp.int32), state)), rounds, sps)
             for l in range(gamma + 1)}
  best = max(uniform, key=uniform.get)
  out["uniform"] = uniform[best]
  out["uniform_len"] = best
  out["oracle"] = oracle(rounds, sps, seed)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--table", action="append", type=parse_table,
                      help="c:N=rate,... a round table (repeatable; default: the H100's)")
  parser.add_argument("--rates", type=lambda s: synthetic.check_rates(
      float(r) for r in s.split(",")), default=synthetic.DEFAULT_RATES)
  parser.add_argument("--spread", type=lambda s: [float(x) for x in s.split(",")],
                      default=[0, 1, 2, 3], help="comma list of σ (default 0,1,2,3)")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  tables = dict(args.table) if args.table else H100_TABLES
  rows = []
  for spread in args.spread:
    for c, table in sorted(tables.items()):
      r = study(c, table, args.rates, spread, args.rounds, args.seed)
      rows.append([f"{spread:g}", str(c), f"{r['fixed']:.0f}", f"{r['prefix']:.0f}",
                   f"{r['top_k']:.0f}", f"{r['uniform']:.0f} (ℓ={r['uniform_len']})",
                   f"{r['oracle']:.0f}", f"{r['prefix'] / r['fixed']:.2f}",
                   f"{r['top_k'] / r['fixed']:.2f}", f"{r['oracle'] / r['fixed']:.2f}"])
  print(f"modelled tokens/s (rates {','.join(map(str, args.rates))}; {args.rounds} rounds of "
        "c rows each)")
  for line in harness.format_table(["σ", "c", "fixed", "prefix", "top_k (lag 2)", "uniform ℓ*",
                                    "oracle", "prefix/fixed", "top_k/fixed", "oracle/fixed"],
                                   rows):
    print(line)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
