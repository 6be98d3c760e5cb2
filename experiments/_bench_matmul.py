"""`benchmark.py matmul`: the update with `model.matmul_dtype=bfloat16` (bfloat16 matmul
inputs, float32 accumulation) against float32, on the same weights and rows, alternated.

For each T: one GSPO update step (`_bench.update_program`, one minibatch of B x G rows,
prompts shared) of each model, timed in turn (float32, bfloat16, float32, ...) after a
first call each; the paired speed-up is the median of the rounds' ratios. Model GFLOP/s
(`_bench.update_flops`) of each, beside the float32 and bfloat16 -> float32 matmul peaks
measured in the same process. The price: how far the bfloat16 model's teacher-forced
log-probs are from float32's on the same tokens (per token, and per sequence as the mean
GSPO's ratio takes: the length-normalised log-ratio the clip range 3e-4 / 4e-4 is set
against), and the first step's loss and gradient norm of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from experiments import _bench
from experiments._bench_bandwidth import SHAPES


def add_parser(sub) -> None:
  p = sub.add_parser("matmul", help="the update with bfloat16 matmul inputs vs float32")
  p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
  p.add_argument("--repeats", type=int, default=3)


def _logp_gap(mcfg_a, mcfg_b, params, batch) -> dict:
  from flax import nnx

  from gspo_jax.models import transformer
  from gspo_jax.rollout.teacher_forcing import response_logprobs

  def logp(mcfg):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: transformer.Transformer(
        mcfg, rngs=nnx.Rngs(0))))
    fn = jax.jit(lambda p: response_logprobs(nnx.merge(graphdef, p), batch.prompts_BxP,
                                             batch.prompt_lens_B, batch.tokens_BxGxT)[0])
    return np.asarray(fn(params), np.float64)
  d = logp(mcfg_b) - logp(mcfg_a)
  seq = d.mean(axis=-1)
  return {"token_max_abs": float(np.abs(d).max()), "token_mean_abs": float(np.abs(d).mean()),
          "seq_mean_log_ratio_max_abs": float(np.abs(seq).max()),
          "seq_mean_log_ratio_mean_abs": float(np.abs(seq).mean())}


def bench_matmul(args) -> dict:
  from flax import nnx

  from experiments._bench import bench_peak
  from gspo_jax.models import config, transformer
  peak = bench_peak(argparse.Namespace(sizes=[1024, 2048], repeats=3))
  f32 = config.ModelConfig(rope_theta=1e6, **SHAPES[args.shape])
  bf16 = dataclasses.replace(f32, matmul_dtype="bfloat16")
  rows_total = args.prompts * args.group
  out = {"shape": {"name": args.shape, **dataclasses.asdict(f32)}, "peak": peak, "rows": []}
  for T in args.new_tokens:
    steps = {}
    for name, mcfg in (("float32", f32), ("bf16_matmul", bf16)):
      update, state, inputs = _bench.update_program(mcfg, rows_total, args.prompt_len, T,
                                                    group=args.group, share_prompts=True)
      t0 = time.perf_counter()
      state, metrics = update(state, *inputs)
      jax.block_until_ready(state)
      steps[name] = [update, state, inputs, time.perf_counter() - t0, jax.device_get(metrics)]
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
      for name, s in steps.items():
        t0 = time.perf_counter()
        s[1], _ = s[0](s[1], *s[2])
        jax.block_until_ready(s[1])
        times[name].append(time.perf_counter() - t0)
    flops = _bench.update_flops(f32, rows_total, args.prompt_len, T)["step"]
    ratios = [a / b for a, b in zip(times["float32"], times["bf16_matmul"])]
    # The gap on the same (initial) weights and tokens: a fresh float32 model's parameters.
    params = nnx.state(transformer.create(f32), nnx.Param)
    row = {"T": T, "rows": rows_total, "P": args.prompt_len, "model_flops": flops,
           "speedup_paired": statistics.median(ratios),
           "logp_gap": _logp_gap(f32, bf16, params, steps["float32"][2][0])}
    for name, s in steps.items():
      med = statistics.median(times[name])
      row[name] = {"seconds": med, "all_seconds": times[name], "first_call_seconds": s[3],
                   "model_gflops_per_s": flops / med / 1e9,
                   "first_step_loss": float(s[4]["loss"]),
                   "first_step_grad_norm": float(s[4]["grad_norm"])}
    out["rows"].append(row)
    g = row["logp_gap"]
    print(f"T={T:5d}: float32 {row['float32']['seconds']:.3f} s "
          f"({row['float32']['model_gflops_per_s']:.1f} GFLOP/s), bf16 matmuls "
          f"{row['bf16_matmul']['seconds']:.3f} s ({row['bf16_matmul']['model_gflops_per_s']:.1f}"
          f" GFLOP/s): paired {row['speedup_paired']:.2f}x; log-prob gap per token max "
          f"{g['token_max_abs']:.1e} mean {g['token_mean_abs']:.1e}, per sequence (mean) max "
          f"{g['seq_mean_log_ratio_max_abs']:.1e}; first step grad norm "
          f"{row['float32']['first_step_grad_norm']:.4f} vs "
          f"{row['bf16_matmul']['first_step_grad_norm']:.4f}")
  return out
