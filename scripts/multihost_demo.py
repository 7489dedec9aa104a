"""Sharded decoding over several processes (hosts): JAX's multi-controller model, one process each.

Every process runs this same script with its own ``--process-id``. Each one:

1. calls ``jax.distributed.initialize(coordinator_address, num_processes, process_id)`` before any
   other JAX call (process 0 hosts the coordinator at that address);
2. builds the same ``(dp, tp)`` mesh from ``jax.devices()`` (every process's devices, in the same
   order everywhere; `dspark_jax.make_mesh`);
3. loads the checkpoint straight into shards (``load_pretrained(..., mesh=mesh)``): each process
   reads from disk only the parts its own devices hold;
4. runs the same ``generate`` call: XLA partitions the program over the whole mesh and issues
   the collectives across processes (NCCL on GPUs; Gloo on the CPU).

It prints one JSON line, ``{"process": i, "devices": n, "local_devices": m, "tokens": [...]}``
(the tokens are replicated: every process reads the whole batch), also written to ``--out``.

  # host i of P, each with its GPUs (the checkpoint directories visible on every host):
  python scripts/multihost_demo.py --coordinator host0:1234 --num-processes P --process-id i \\
      --target /ckpt/qwen3-8b --draft /ckpt/dspark --tp 8 --prompts "[[9707, 11, 1879]]"
  # two processes on this machine's CPU, two devices each (tests/test_sharding.py runs this):
  python scripts/multihost_demo.py --coordinator localhost:12355 --num-processes 2 \\
      --process-id 0 --cpu-devices 2 --target T --draft D --tp 4 &
  python scripts/multihost_demo.py --coordinator localhost:12355 --num-processes 2 \\
      --process-id 1 --cpu-devices 2 --target T --draft D --tp 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--coordinator", required=True, help="host:port of process 0")
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--cpu-devices", type=int, default=None,
                      help="run on the CPU with this many devices per process (tests, demos)")
  parser.add_argument("--target", required=True, help="a Hugging Face Qwen3 checkpoint directory")
  parser.add_argument("--draft", default=None, help="a DeepSpec or speculators draft directory")
  parser.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
  parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
  parser.add_argument("--prompts", default="[[1, 2, 3], [4, 5]]", help="JSON: token-id lists")
  parser.add_argument("--max-new-tokens", type=int, default=10)
  parser.add_argument("--out", default=None, help="also write the JSON line to this file")
  return parser.parse_args(argv)


def main(argv=None) -> dict:
  args = parse(argv)
  if args.cpu_devices is not None:      # read by XLA when the CPU client starts: before JAX runs
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={args.cpu_devices}").strip()
  import jax
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id)
  import dspark_jax as dj

  mesh = dj.make_mesh(args.tp, args.dp)
  dp = "dp" if args.dp > 1 else None
  target, draft = dj.load_pretrained(args.target, args.draft, mesh=mesh, dp=dp)
  prompts = json.loads(args.prompts)
  params = dj.SamplingParams(temperature=0.0, batch_size=len(prompts))
  out = dj.generate(target, draft, prompts, params, jax.random.key(0),
                    max_new_tokens=args.max_new_tokens, spec=draft is not None)
  result = {"process": jax.process_index(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "tokens": out.tokens.tolist()}
  line = json.dumps(result)
  print(line, flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write(line + "\n")
  jax.distributed.shutdown()
  return result


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main()
