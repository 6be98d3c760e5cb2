"""`benchmark.py long`: the loop at long response lengths T (256, 512, 1,024 by default).

Sampler: the in-graph group sampler at each T, twice:
  full      EOS is one id of the vocabulary, rarely drawn: the loop runs all T steps
            (tokens/s, ms per decode step);
  varying   response lengths spread out: the last layer's unembedding is zeroed so every
            token of the first `vocab_limit` ids is equally likely, and vocab_limit =
            T * --stop-frac makes each step end a row with probability 1 / vocab_limit,
            i.e. geometric lengths with mean ~ T * stop-frac. The while loop runs until the
            longest row ends, so it computes B G steps token positions for sum |y| kept:
            `wasted_frac` = 1 - kept / (B G steps) is the share of decode work spent on rows
            that had already ended.
Compact: the varying-lengths sampler with live-row compaction off and on
(`SamplerConfig.compact_rows` = --compact-rows), both compiled first, then timed
alternately (off, on, off, on, ...) in this process: the on/off ratio of the medians, and
whether the two rollouts agree (same tokens; largest log-prob difference).
Update: one update step (`step.update`, one minibatch of --rows rows of P + T tokens, lean
log-probs as always in teacher forcing) at each T, remat mode and --attention-chunk
(`ModelConfig.attention_chunk`; 0 = off): seconds and XLA's memory analysis of the compiled
program (temporaries, arguments, outputs; peak ~ temp + args +
outputs not aliased to the donated state).

Each figure is measured in this process on the same inputs; rerun on a quiet machine
before trusting a time (every record holds the load average).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _bench
from experiments._bench import timed, update_flops


def add_parser(sub) -> None:
  p = sub.add_parser("long", help="sampler and update step at long response lengths")
  p.add_argument("--new-tokens", type=int, nargs="+", default=[256, 512, 1024])
  _bench.add_shape_args(p)
  p.add_argument("--stop-frac", type=float, default=0.25,
                 help="varying lengths: mean response length ~ this fraction of T")
  p.add_argument("--rows", type=int, default=16, help="rows of the update's minibatch")
  p.add_argument("--remat", nargs="+", default=["none", "full"], choices=("none", "full", "dots"))
  p.add_argument("--attention-chunk", type=int, nargs="+", default=[0],
                 help="update: ModelConfig.attention_chunk values (0 = off) at each T and remat")
  p.add_argument("--parts", nargs="+", default=["sampler", "update"],
                 choices=("sampler", "update", "compact"))
  p.add_argument("--compact-rows", type=int, default=2,
                 help="compact: SamplerConfig.compact_rows of the compacted sampler")
  p.add_argument("--repeats", type=int, default=2)


def _model(args, T: int):
  from gspo_jax.models import config
  return config.tiny(vocab_size=args.vocab, hidden=args.width, num_layers=args.layers,
                     mlp_dim=4 * args.width, num_heads=4, num_kv_heads=2,
                     head_dim=args.width // 4)


def _flat_unembedding(model) -> None:
  """Zero the unembedding: every logit 0, so sampling is uniform over the allowed ids."""
  model.lm_head.value = jnp.zeros_like(model.lm_head.value)


def sampler_row(args, T: int, varying: bool) -> dict:
  from gspo_jax.models import transformer
  from gspo_jax.rollout import sampling
  mcfg = _model(args, T)
  model = transformer.create(mcfg)
  B, P, G = args.prompts, args.prompt_len, args.group
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, args.vocab, (B, P)), jnp.int32)
  lens = jnp.full((B,), P, jnp.int32)
  if varying:
    _flat_unembedding(model)
    limit = max(2, round(T * args.stop_frac))
    scfg = sampling.SamplerConfig(group_size=G, max_new_tokens=T, eos_id=1, max_prompt_len=P,
                                  vocab_limit=limit)
  else:  # EOS = the last id, drawn rarely: the loop runs all T steps
    scfg = sampling.SamplerConfig(group_size=G, max_new_tokens=T, eos_id=args.vocab - 1,
                                  max_prompt_len=P)
  key = jax.random.key(0)
  run = lambda: sampling.sample_groups(model, prompts, lens, key, scfg)
  t0 = time.perf_counter()
  rollout = jax.block_until_ready(run())
  first = time.perf_counter() - t0
  sec = timed(run, repeats=args.repeats)
  one = dataclasses.replace(scfg, max_new_tokens=1)
  prefill = timed(lambda: sampling.sample_groups(model, prompts, lens, key, one),
                  repeats=args.repeats)
  steps = int(rollout.steps)
  lengths = np.asarray(rollout.lengths_BxG).reshape(-1)
  kept, computed = int(lengths.sum()), B * G * steps
  return {"T": T, "lengths": "varying" if varying else "full", "steps": steps,
          "tokens_kept": kept, "token_positions_computed": computed,
          "wasted_frac": 1 - kept / computed, "length_mean": float(lengths.mean()),
          "length_p90": float(np.quantile(lengths, 0.9)), "length_max": int(lengths.max()),
          "seconds": sec, "first_call_seconds": first, "prefill_seconds": prefill,
          "kept_tokens_per_s": kept / sec,
          "ms_per_decode_step": 1e3 * (sec - prefill) / max(steps - 1, 1)}


def compact_row(args, T: int) -> dict:
  """Compaction off vs on at varying lengths, timed alternately (see the module docstring)."""
  from gspo_jax.models import transformer
  from gspo_jax.rollout import sampling
  model = transformer.create(_model(args, T))
  _flat_unembedding(model)
  B, P, G = args.prompts, args.prompt_len, args.group
  prompts = jnp.asarray(np.random.default_rng(0).integers(2, args.vocab, (B, P)), jnp.int32)
  lens = jnp.full((B,), P, jnp.int32)
  off = sampling.SamplerConfig(group_size=G, max_new_tokens=T, eos_id=1, max_prompt_len=P,
                               vocab_limit=max(2, round(T * args.stop_frac)))
  on = dataclasses.replace(off, compact_rows=args.compact_rows)
  key = jax.random.key(0)
  runs = {name: (lambda c=c: sampling.sample_groups(model, prompts, lens, key, c))
          for name, c in (("off", off), ("on", on))}
  first, rollouts = {}, {}
  for name, run in runs.items():
    t0 = time.perf_counter()
    rollouts[name] = jax.block_until_ready(run())
    first[name] = time.perf_counter() - t0
  times = {"off": [], "on": []}
  for _ in range(args.repeats):
    for name, run in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - t0)
  med = {name: float(np.median(t)) for name, t in times.items()}
  a, b = rollouts["off"], rollouts["on"]
  lengths = np.asarray(a.lengths_BxG).reshape(-1)
  return {"T": T, "compact_rows": args.compact_rows, "steps": int(a.steps),
          "wasted_frac": 1 - int(lengths.sum()) / (B * G * int(a.steps)),
          "seconds_off": med["off"], "seconds_on": med["on"], "on_over_off": med["on"] / med["off"],
          "times_off": times["off"], "times_on": times["on"],
          "first_call_seconds_off": first["off"], "first_call_seconds_on": first["on"],
          "same_tokens": bool(np.array_equal(a.tokens_BxGxT, b.tokens_BxGxT)),
          "same_steps": int(a.steps) == int(b.steps),
          "max_logp_diff": float(np.abs(np.asarray(a.logp_BxGxT) - np.asarray(b.logp_BxGxT)).max())}


def update_row(args, T: int, remat: str, attention_chunk: int = 0) -> dict:
  mcfg = dataclasses.replace(_model(args, T), remat=remat, attention_chunk=attention_chunk)
  step, state, inputs = _bench.update_program(mcfg, args.rows, args.prompt_len, T)
  t0 = time.perf_counter()
  compiled = step.lower(state, *inputs).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  box = [state]

  def once():
    box[0], metrics = compiled(box[0], *inputs)
    return metrics

  sec = timed(once, repeats=args.repeats)
  flops = update_flops(mcfg, args.rows, args.prompt_len, T)["step"]
  return {"T": T, "remat": remat, "attention_chunk": attention_chunk, "seconds": sec, "compile_seconds": compile_s,
          "model_gflops_per_s": flops / sec / 1e9,
          "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
          "output_bytes": mem.output_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
          "peak_bytes_estimate": (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                  + mem.output_size_in_bytes - mem.alias_size_in_bytes)}


def bench_long(args) -> dict:
  out = {"shape": {"B": args.prompts, "G": args.group, "P": args.prompt_len,
                   "hidden": args.width, "layers": args.layers, "vocab": args.vocab,
                   "update_rows": args.rows, "stop_frac": args.stop_frac},
         "sampler": [], "update": [], "compact": []}
  if "sampler" in args.parts:
    print(f"{'T':>5} {'lengths':8} {'steps':>6} {'kept':>7} {'computed':>9} {'wasted':>7} "
          f"{'mean':>7} {'p90':>6} {'max':>5} {'s':>7} {'kept tok/s':>11} {'ms/step':>8}")
    for T in args.new_tokens:
      for varying in (False, True):
        r = sampler_row(args, T, varying)
        out["sampler"].append(r)
        print(f"{T:5d} {r['lengths']:8} {r['steps']:6d} {r['tokens_kept']:7d} "
              f"{r['token_positions_computed']:9d} {r['wasted_frac']:7.1%} "
              f"{r['length_mean']:7.1f} {r['length_p90']:6.0f} {r['length_max']:5d} "
              f"{r['seconds']:7.3f} {r['kept_tokens_per_s']:11.0f} "
              f"{r['ms_per_decode_step']:8.2f}", flush=True)
  if "compact" in args.parts:
    print(f"{'T':>5} {'L':>2} {'steps':>6} {'wasted':>7} {'off s':>7} {'on s':>7} {'on/off':>7} "
          f"{'same':>5} {'max dlogp':>10}")
    for T in args.new_tokens:
      r = compact_row(args, T)
      out["compact"].append(r)
      print(f"{T:5d} {r['compact_rows']:2d} {r['steps']:6d} {r['wasted_frac']:7.1%} "
            f"{r['seconds_off']:7.3f} {r['seconds_on']:7.3f} {r['on_over_off']:7.3f} "
            f"{str(r['same_tokens'] and r['same_steps']):>5} {r['max_logp_diff']:10.2e}",
            flush=True)
  if "update" in args.parts:
    print(f"{'T':>5} {'remat':6} {'chunk':>5} {'step s':>8} {'GFLOP/s':>8} {'temp MiB':>9} "
          f"{'peak MiB':>9} {'compile s':>10}")
    for T in args.new_tokens:
      for remat in args.remat:
        for chunk in args.attention_chunk:
          r = update_row(args, T, remat, chunk)
          out["update"].append(r)
          print(f"{T:5d} {remat:6} {chunk:5d} {r['seconds']:8.3f} "
                f"{r['model_gflops_per_s']:8.1f} {r['temp_bytes'] / 2**20:9.1f} "
                f"{r['peak_bytes_estimate'] / 2**20:9.1f} {r['compile_seconds']:10.2f}",
                flush=True)
  return out
