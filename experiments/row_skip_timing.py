"""Seconds per update with and without `row_skip.enabled`, paired in one process.

    python -m experiments.row_skip_timing --new-tokens 64 256 --degenerate 0 0.25 0.5

One GSPO update (`step.update` under `jax.jit`, the state not donated, so every call does
the same work from the same parameters) on B prompts x G responses of P + T tokens, every
response token counted, `--minibatches` optax steps. pi_old is the current policy's
log-probs plus N(0, `--noise`) per token, so some sequence ratios are clipped from the first
minibatch on, and the parameters' move after each step clips more (the paper's clip range,
3e-4 / 4e-4); a `--degenerate` share of the groups has equal rewards (zero advantages), the
others N(0, 1) rewards. Each setting times the full update and the skipping one in turn
(full, skip, full, skip, ...) `--repeats` times after a first call each (compilation), and
reports the medians, the median of the per-round ratios (paired; of wall time and of the
process's CPU time, which other jobs on a shared machine disturb less), and the skip's own
metrics: `row_skip_dead_frac` (rows with exactly zero gradient) and `row_skip_saved_frac`
(rows left out of the backward pass), averaged over the minibatches. The full and the
skipping update's losses and gradient norms are stored side by side. Writes
runs/results/row_skip_timing.json (experiments/results/ with --record).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import _bench, _results
from gspo_jax.config import LossConfig, RolloutConfig, TrainConfig
from gspo_jax.models import config as model_config
from gspo_jax.models import transformer
from gspo_jax.objectives.row_skip import RowSkipConfig
from gspo_jax.train import optim, programs, step


def model_cfg(args) -> model_config.ModelConfig:
  return model_config.ModelConfig(
      vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
      num_kv_heads=args.kv_heads, head_dim=args.head_dim, mlp_dim=args.mlp, rope_theta=1e6,
      rms_eps=1e-6, qk_norm=True, dtype="float32", param_dtype="float32")


def train_cfg(args, T: int, skip: bool) -> TrainConfig:
  return TrainConfig(
      model=model_cfg(args), loss=LossConfig(name="gspo"), num_minibatches=args.minibatches,
      share_prompts=args.share_prompts,
      rollout=RolloutConfig(prompts_per_iter=args.prompts, group_size=args.group,
                            max_new_tokens=T, max_prompt_len=args.prompt_len),
      row_skip=RowSkipConfig(enabled=skip, buckets=args.buckets))


def make_batch(graphdef, params, args, T: int, degenerate: float):
  """(batch, rewards_BxG) as the module docstring says."""
  B, G, P = args.prompts, args.group, args.prompt_len
  rng = np.random.default_rng(1)
  prompts = jnp.asarray(rng.integers(1, args.vocab, (B, P)), jnp.int32)
  tokens = jnp.asarray(rng.integers(1, args.vocab, (B, G, T)), jnp.int32)
  mask = jnp.ones((B, G, T), jnp.float32)
  rows = step.Batch(prompts, jnp.full((B,), P, jnp.int32), tokens, mask, mask)
  scfg = programs.step_config(train_cfg(args, T, False))
  logp = jax.jit(lambda p, r: step.policy_logprobs(p, graphdef, r, scfg)[0])(params, rows)
  noise = jnp.asarray(rng.normal(0.0, args.noise, (B, G, T)), jnp.float32)
  rewards = rng.normal(0.0, 1.0, (B, G)).astype(np.float32)
  rewards[:round(degenerate * B)] = 1.0
  return rows.replace(old_logp_BxGxT=logp + noise), jnp.asarray(rewards)


def update_fn(graphdef, params, args, T: int, skip: bool):
  cfg = train_cfg(args, T, skip)
  tx = optim.make_optimizer(cfg.optim)
  state = step.TrainState(params=params, opt_state=tx.init(params),
                          step=jnp.zeros((), jnp.int32), key=jax.random.key(0))
  fn = jax.jit(functools.partial(step.update, graphdef=graphdef, tx=tx,
                                 cfg=programs.step_config(cfg)))
  return lambda batch, rewards: jax.device_get(fn(state, batch, rewards)[1])


def bench(graphdef, params, args, T: int, degenerate: float) -> dict:
  batch, rewards = make_batch(graphdef, params, args, T, degenerate)
  fns = {name: update_fn(graphdef, params, args, T, skip)
         for name, skip in (("full", False), ("skip", True))}
  first, metrics = {}, {}
  for name, fn in fns.items():
    t0 = time.perf_counter()
    metrics[name] = fn(batch, rewards)
    first[name] = time.perf_counter() - t0
  times = {name: [] for name in fns}
  cpu = {name: [] for name in fns}
  for _ in range(args.repeats):
    for name, fn in fns.items():
      t0, c0 = time.perf_counter(), time.process_time()
      fn(batch, rewards)
      times[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  full, skip = metrics["full"], metrics["skip"]
  paired = lambda d: statistics.median(a / b for a, b in zip(d["full"], d["skip"]))
  return {
      "new_tokens": T, "degenerate_groups": degenerate,
      "first_call_s": first, "times_s": times, "cpu_s": cpu,
      "median_s": {k: statistics.median(v) for k, v in times.items()},
      "median_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
      "paired_speedup": paired(times), "paired_cpu_speedup": paired(cpu),
      "row_skip_dead_frac": float(skip["row_skip_dead_frac"]),
      "row_skip_saved_frac": float(skip["row_skip_saved_frac"]),
      "clip_frac_seq": float(full["clip_frac_seq"]),
      "loss": [float(full["loss"]), float(skip["loss"])],
      "grad_norm": [float(full["grad_norm"]), float(skip["grad_norm"])],
  }


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--mlp", type=int, default=768)
  p.add_argument("--prompts", type=int, default=8, help="B")
  p.add_argument("--group", type=int, default=4, help="G")
  p.add_argument("--prompt-len", type=int, default=32, help="P")
  p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256], help="T values")
  p.add_argument("--degenerate", type=float, nargs="+", default=[0.0, 0.25, 0.5],
                 help="shares of the groups with equal rewards")
  p.add_argument("--minibatches", type=int, default=4)
  p.add_argument("--share-prompts", action="store_true")
  p.add_argument("--buckets", type=int, default=4, help="row_skip.buckets")
  p.add_argument("--noise", type=float, default=0.01, help="pi_old = pi_theta + N(0, noise)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default=None)
  _results.add_record_arg(p)
  return p


def main(argv=None):
  args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
  graphdef, params = nnx.split(transformer.create(model_cfg(args)), nnx.Param)
  record = {"command": "python -m experiments.row_skip_timing " + " ".join(
      sys.argv[1:] if argv is None else argv), "args": vars(args), "machine": _bench.machine(),
      "loadavg_before": os.getloadavg(), "results": []}
  for T in args.new_tokens:
    for share in args.degenerate:
      r = bench(graphdef, params, args, T, share)
      record["results"].append(r)
      print(f"T={T:5d} degenerate={share:.2f}: full {r['median_s']['full']:.3f} s, skip "
            f"{r['median_s']['skip']:.3f} s, paired {r['paired_speedup']:.2f}x (CPU time "
            f"{r['paired_cpu_speedup']:.2f}x); dead "
            f"{r['row_skip_dead_frac']:.2f}, saved {r['row_skip_saved_frac']:.2f}, "
            f"clip_frac_seq {r['clip_frac_seq']:.2f}", flush=True)
  record["loadavg_after"] = os.getloadavg()
  _results.write_record(args, "row_skip_timing.json", record)


if __name__ == "__main__":
  main()
