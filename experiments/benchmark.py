"""Benchmarks. Each subcommand prints a table and writes JSON under experiments/results/.

    python experiments/benchmark.py peak       # measured matmul FLOP/s (the ceiling)
    python experiments/benchmark.py logprobs   # lean vs plain token log-probs: memory, time

Figures are measured in one process; ratios compare runs of the same process on the
same input. Machines are noisy: rerun before trusting a small difference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.logprobs import token_logprobs, token_logprobs_from_hidden

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
  dev = jax.devices()[0]
  return {"platform": platform.platform(), "python": platform.python_version(),
          "jax": jax.__version__, "backend": jax.default_backend(),
          "device_kind": dev.device_kind, "device_count": jax.device_count(),
          "cpu_count": os.cpu_count()}


def timed(fn, *args, repeats: int = 3) -> float:
  """Median wall seconds of `fn(*args)` after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def write(name: str, record: dict, out_dir: str) -> str:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"benchmark_{name}.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=2)
  return path


def bench_peak(args) -> dict:
  rows = []
  for n in args.sizes:
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    sec = timed(f, a, a, repeats=args.repeats)
    rows.append({"n": n, "seconds": sec, "gflops": 2 * n**3 / sec / 1e9})
    print(f"matmul {n:5d}x{n:<5d} f32  {rows[-1]['gflops']:8.1f} GFLOP/s")
  return {"peak_gflops": max(r["gflops"] for r in rows), "rows": rows}


def bench_logprobs(args) -> dict:
  B, T, D, V = args.batch, args.tokens, args.width, args.vocab
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(0, 1, (B, T, D)), jnp.float32)
  w = jnp.asarray(rng.normal(0, D**-0.5, (D, V)), jnp.float32)
  tok = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)

  def plain(h, w):
    return jnp.sum(token_logprobs(jnp.einsum("btd,dv->btv", h, w), tok))

  def lean(h, w):
    return jnp.sum(token_logprobs_from_hidden(h, w, tok, chunk_size=args.chunk))

  out = {"shape": {"B": B, "T": T, "D": D, "V": V, "chunk_size": args.chunk}}
  full_logits = B * T * V * 4
  for name, f in (("plain", plain), ("lean", lean)):
    grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
    t0 = time.perf_counter()
    compiled = grad.lower(h, w).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    sec = timed(compiled, h, w, repeats=args.repeats)
    out[name] = {"temp_bytes": temp, "temp_over_full_logits": temp / full_logits,
                 "seconds": sec, "compile_seconds": compile_s}
  # Values agree (the tests check gradients too).
  vp, vl = jax.jit(plain)(h, w), jax.jit(lean)(h, w)
  out["abs_diff_sum_logp"] = float(abs(vp - vl))
  out["memory_ratio_plain_over_lean"] = out["plain"]["temp_bytes"] / out["lean"]["temp_bytes"]
  out["time_ratio_lean_over_plain"] = out["lean"]["seconds"] / out["plain"]["seconds"]
  print(f"value_and_grad of sum(logp), B={B} T={T} D={D} V={V} chunk={args.chunk}; "
        f"one B x T x V f32 logits array = {full_logits / 2**20:.0f} MiB")
  print(f"{'path':6} {'temp MiB':>10} {'x logits':>9} {'step s':>8} {'compile s':>10}")
  for name in ("plain", "lean"):
    r = out[name]
    print(f"{name:6} {r['temp_bytes'] / 2**20:10.1f} {r['temp_over_full_logits']:9.3f} "
          f"{r['seconds']:8.3f} {r['compile_seconds']:10.2f}")
  print(f"memory plain/lean = {out['memory_ratio_plain_over_lean']:.1f}x; "
        f"time lean/plain = {out['time_ratio_lean_over_plain']:.2f}x; "
        f"|sum logp difference| = {out['abs_diff_sum_logp']:.3g}")
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=RESULTS, help="directory for the JSON record")
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("peak", help="matmul throughput")
  p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
  p.add_argument("--repeats", type=int, default=5)
  p = sub.add_parser("logprobs", help="lean vs plain token log-probs")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--tokens", type=int, default=1024)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--vocab", type=int, default=151936)  # Qwen3's vocabulary
  p.add_argument("--chunk", type=int, default=128)
  p.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  result = {"peak": bench_peak, "logprobs": bench_logprobs}[args.cmd](args)
  record = {"command": "python experiments/benchmark.py " + " ".join(argv or sys.argv[1:]),
            "args": vars(args),
            "machine": machine(), "result": result}
  print("wrote", write(args.cmd, record, args.out))


if __name__ == "__main__":
  main()
