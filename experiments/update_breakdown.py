"""Where an update's time goes: its parts timed alone, alternated in one process.

    python -m experiments.update_breakdown --new-tokens 256

The shape of `row_skip_timing` (tiny Qwen3, B x G rows of P + T tokens, `--minibatches`).
Each part is its own jitted program on the same rows, and the parts are called in turn
(`--repeats` rounds after a compiling call each); the report is each part's median wall and
CPU seconds and its model FLOP/s (`_bench.update_flops`):
  forward      teacher-forced log-probs of one minibatch (`step.policy_logprobs`)
  loss_grad    value and gradient of the minibatch loss (`step.minibatch_loss`)
  optimizer    the optax step on a gradient of the parameters' shapes
  update       the whole update: advantages, the minibatch scan (M x (loss_grad +
               optimizer)), metrics
  loss_grad_1  the gradient over all B x G rows as one minibatch (the scan's cost of
               splitting)
Writes runs/results/update_breakdown.json (experiments/results/ with --record).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments import _bench, _results
from experiments.row_skip_timing import build_parser, make_batch, model_cfg, train_cfg
from gspo_jax.models import transformer
from gspo_jax.objectives.advantages import group_advantages
from gspo_jax.train import optim, programs, step


def parts(graphdef, params, args, T: int) -> dict:
  """name -> (zero-argument callable that blocks, model FLOPs)."""
  cfg = train_cfg(args, T, skip=False)
  scfg = programs.step_config(cfg)
  tx = optim.make_optimizer(cfg.optim)
  batch, rewards = make_batch(graphdef, params, args, T, degenerate=0.0)
  M, R = args.minibatches, args.prompts * args.group
  mb_rows = R // M
  adv = group_advantages(rewards)
  mb = step.split_minibatches(jax.random.key(0), batch, adv, scfg)
  one = jax.tree.map(lambda x: x[0], mb)
  whole = step.Minibatch(batch, adv)
  flops = lambda rows: _bench.update_flops(cfg.model, rows, args.prompt_len, T)
  fwd = jax.jit(lambda p, m: step.policy_logprobs(p, graphdef, m.rows, scfg)[0])
  grad = jax.jit(jax.value_and_grad(
      lambda p, m: step.minibatch_loss(p, graphdef, m, scfg)[0]))
  opt_state = tx.init(params)
  opt = jax.jit(lambda p, g, s: (lambda u, s2: (optax.apply_updates(p, u), s2))(
      *tx.update(g, s, p)))
  state = step.TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32),
                          key=jax.random.key(0))
  update = jax.jit(functools.partial(step.update, graphdef=graphdef, tx=tx, cfg=scfg))
  grads = jax.tree.map(jnp.ones_like, params)
  block = jax.block_until_ready
  return {
      "forward": (lambda: block(fwd(params, one)), flops(mb_rows)["forward"]),
      "loss_grad": (lambda: block(grad(params, one)), flops(mb_rows)["step"]),
      "optimizer": (lambda: block(opt(params, grads, opt_state)), 0),
      "update": (lambda: block(update(state, batch, rewards)), flops(R)["step"]),
      "loss_grad_1": (lambda: block(grad(params, whole)), flops(R)["step"]),
  }


def main(argv=None):
  args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
  graphdef, params = nnx.split(transformer.create(model_cfg(args)), nnx.Param)
  record = {"command": "python -m experiments.update_breakdown " + " ".join(
      sys.argv[1:] if argv is None else argv), "machine": _bench.machine(),
      "loadavg_before": os.getloadavg(), "results": {}}
  for T in args.new_tokens:
    fns = parts(graphdef, params, args, T)
    for fn, _ in fns.values():
      fn()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(args.repeats):
      for k, (fn, _) in fns.items():
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall[k].append(time.perf_counter() - t0)
        cpu[k].append(time.process_time() - c0)
    out = {}
    for k, (_, flops) in fns.items():
      w, c = statistics.median(wall[k]), statistics.median(cpu[k])
      out[k] = {"wall_s": w, "cpu_s": c, "gflop": flops / 1e9,
                "gflop_per_s": flops / 1e9 / w if flops else None}
      print(f"T={T} {k:12s} wall {w:.3f} s  cpu {c:.3f} s  {flops / 1e9:7.2f} GFLOP"
            + (f"  {flops / 1e9 / w:6.1f} GFLOP/s" if flops else ""), flush=True)
    record["results"][str(T)] = out
  record["loadavg_after"] = os.getloadavg()
  _results.write_record(args, "update_breakdown.json", record)


if __name__ == "__main__":
  main()
