"""Benchmarks. Each subcommand prints a table and writes JSON under runs/results/.

    python -m experiments.benchmark            # = `all`: every measurement at a quick size
    python -m experiments.benchmark peak       # measured matmul FLOP/s (the ceiling)
    python -m experiments.benchmark train      # update step: time, model FLOP/s, MFU vs peak
    python -m experiments.benchmark logprobs   # lean vs plain token log-probs: memory, time
    python -m experiments.benchmark sampler    # in-graph group sampler vs a host-driven loop
    python -m experiments.benchmark prefix     # update step with / without prompt sharing
    python -m experiments.benchmark iteration  # one GSPO iteration: the loop, by phase, fused
    python -m experiments.benchmark compile    # compile time vs number of layers
    python -m experiments.benchmark long       # sampler and update at T = 256 / 512 / 1024
    python -m experiments.benchmark decode     # ms per decode step at T = 64 / 256 / 1024 vs a commit

`python experiments/benchmark.py ...` works too: run as a file, it runs itself as the
module above (the two stanzas below), so its package imports resolve the same way.

`all` writes benchmark_all.json (every record at its quick size, see QUICK); a subcommand
writes benchmark_<name>.json at its full size. Figures are measured in one process; ratios
compare runs of the same process on the same input. Machines are noisy: every record holds
the load average before and after it; rerun before trusting a small difference.
The JSON goes to runs/results/ (ignored by git); --record (before the subcommand) writes the
committed experiments/results/ instead, and --out DIR anywhere.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
  # Run as a file (`python experiments/benchmark.py`), sys.path[0] is experiments/ itself,
  # where `import experiments` cannot resolve: run this file as the module instead, from the
  # repository root, exactly as `python -m experiments.benchmark` does.
  import os
  import runpy
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  runpy.run_module("experiments.benchmark", run_name="__main__", alter_sys=True)
  raise SystemExit(0)

import argparse
import dataclasses
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import (
  _bench,
  _bench_bandwidth,
  _bench_decode,
  _bench_long,
  _bench_matmul,
  _results,
)
from experiments._bench import bench_peak, machine, timed, update_flops, write
from gspo_jax.models.logprobs import token_logprobs, token_logprobs_from_hidden


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


def _host_loop_sampler(model, cfg, style: str = "nnx"):
  """Baseline: a jitted prefill and a jitted one-token step driven from Python, checking
  on the host after every token whether all responses ended (as HF-style loops do).

  style "nnx": `nnx.jit` steps taking the model (what an NNX user writes first; each call
  walks the module graph on the host). style "jax": `jax.jit` steps on parameters split
  once, the KV cache donated to each step (the leanest host loop: only the dispatch and
  the per-token EOS check remain on the host).
  """
  from flax import nnx

  from gspo_jax.models.transformer import KVCache
  from gspo_jax.rollout import sampling
  from gspo_jax.rollout.teacher_forcing import prompt_forward

  def prefill(model, prompts, lens, key):
    out, valid, last = prompt_forward(model, prompts, lens)
    logits = jnp.broadcast_to(model.logits(last)[:, None],
                              (prompts.shape[0], cfg.group_size, model.cfg.vocab_size))
    token, logp, _ = sampling.pick_token(logits, key, cfg)
    return token, logp, KVCache.from_prefill(out, valid, cfg.group_size, cfg.max_new_tokens)

  def step(model, token, done, positions, cache, key):
    hidden, cache = model.decode(token, positions, cache)
    token, logp, _ = sampling.pick_token(model.logits(hidden), key, cfg)
    token = jnp.where(done, cfg.pad_id, token)  # same bookkeeping as the in-graph sampler
    return token, done | (token == cfg.eos_id), cache

  if style == "nnx":
    model_arg, prefill, step = model, nnx.jit(prefill), nnx.jit(step)
  else:
    graphdef, model_arg = nnx.split(model)
    merged = lambda fn: lambda params, *a: fn(nnx.merge(graphdef, params), *a)
    prefill, step = jax.jit(merged(prefill)), jax.jit(merged(step), donate_argnums=(4,))

  def run(prompts, lens, key):
    token, logp, cache = prefill(model_arg, prompts, lens, jax.random.fold_in(key, 0))
    tokens, done = [token], token == cfg.eos_id
    for t in range(1, cfg.max_new_tokens):
      if bool(jnp.all(done)):  # host round trip every token
        break
      positions = jnp.broadcast_to(lens[:, None] + t - 1, token.shape)
      token, done, cache = step(model_arg, token, done, positions, cache, jax.random.fold_in(key, t))
      tokens.append(token)
    return jnp.stack(tokens, -1)

  return run


HOST_LOOPS = {"nnx": "host loop, nnx.jit step", "jax": "host loop, jax.jit step, donated cache"}


def bench_sampler(args) -> dict:
  from gspo_jax.models import config, transformer
  from gspo_jax.rollout import sampling

  mcfg = config.tiny(vocab_size=args.vocab, hidden=args.width, num_layers=args.layers,
                     mlp_dim=4 * args.width, num_heads=4, num_kv_heads=2, head_dim=args.width // 4,
                     scan_layers=args.scan)
  model = transformer.create(mcfg)
  B, P, G, T = args.prompts, args.prompt_len, args.group, args.new_tokens
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, args.vocab, (B, P)), jnp.int32)
  lens = jnp.full((B,), P, jnp.int32)
  scfg = sampling.SamplerConfig(group_size=G, max_new_tokens=T, eos_id=args.vocab - 1,
                                max_prompt_len=P)
  key = jax.random.key(0)
  t0 = time.perf_counter()
  rollout = jax.block_until_ready(sampling.sample_groups(model, prompts, lens, key, scfg))
  compile_s = time.perf_counter() - t0
  steps = int(rollout.steps)  # decode steps run (all rows advance in lockstep)
  in_graph = timed(lambda: sampling.sample_groups(model, prompts, lens, key, scfg),
                   repeats=args.repeats)
  # The prefill (and first token) alone: what the per-position figures below exclude.
  one_cfg = dataclasses.replace(scfg, max_new_tokens=1)
  prefill = timed(lambda: sampling.sample_groups(model, prompts, lens, key, one_cfg),
                  repeats=args.repeats)
  tokens = B * G * steps
  out = {"model": dataclasses.asdict(mcfg), "B": B, "P": P, "G": G, "T": T, "steps": steps,
         "params": sum(x.size for x in jax.tree.leaves(nnx_params(model))),
         "in_graph_seconds": in_graph, "in_graph_tokens_per_s": tokens / in_graph,
         "in_graph_first_call_seconds": compile_s, "prefill_seconds": prefill,
         "in_graph_ms_per_decode_step": 1e3 * (in_graph - prefill) / max(steps - 1, 1)}
  rows = [("in-graph (shared prefix)", in_graph, compile_s)]
  for style, label in HOST_LOOPS.items():
    host = _host_loop_sampler(model, scfg, style)
    t0 = time.perf_counter()
    host_tokens = jax.block_until_ready(host(prompts, lens, key))
    first_s = time.perf_counter() - t0
    # Same keys, same computation: the baseline must produce the same tokens.
    same = np.array_equal(np.asarray(host_tokens), np.asarray(rollout.tokens_BxGxT)[..., :steps])
    host_s = timed(lambda: host(prompts, lens, key), repeats=args.repeats)
    out[f"host_{style}"] = {
        "tokens_equal_in_graph": same, "seconds": host_s, "tokens_per_s": tokens / host_s,
        "first_call_seconds": first_s, "speedup_in_graph": host_s / in_graph,
        "ms_per_decode_step": 1e3 * (host_s - prefill) / max(steps - 1, 1)}
    rows.append((label, host_s, first_s))
  # Kept under the names earlier records used (the nnx-style loop).
  out["host_loop_tokens_equal_in_graph"] = out["host_nnx"]["tokens_equal_in_graph"]
  out["host_loop_seconds"] = out["host_nnx"]["seconds"]
  out["speedup_in_graph_over_host_loop"] = out["host_nnx"]["speedup_in_graph"]
  # Prefill once per prompt and share its cache (G responses) vs repeat each prompt G times.
  rep_cfg = dataclasses.replace(scfg, group_size=1)
  rep_prompts, rep_lens = jnp.repeat(prompts, G, 0), jnp.repeat(lens, G)
  repeated = timed(lambda: sampling.sample_groups(model, rep_prompts, rep_lens, key, rep_cfg),
                   repeats=args.repeats)
  rows.append(("in-graph, prompt repeated G times", repeated, float("nan")))
  out.update(repeated_prompt_seconds=repeated,
             speedup_shared_prefix_over_repeated=repeated / in_graph)
  print(f"sampler: {out['params'] / 1e6:.2f}M-param model (hidden {args.width}, {args.layers} layers, "
        f"vocab {args.vocab}); B={B} prompts x G={G}, prompt {P} tokens, {steps} of max {T} new "
        f"tokens; host loops' tokens identical: "
        f"{all(out[f'host_{s}']['tokens_equal_in_graph'] for s in HOST_LOOPS)}")
  print(f"{'variant':40} {'seconds':>8} {'tokens/s':>10} {'first call s':>13}")
  for label, sec, first in rows:
    print(f"{label:40} {sec:8.3f} {tokens / sec:10.0f} {first:13.2f}")
  print(f"prefill + first token alone: {prefill:.3f} s; per decode step: in-graph "
        f"{out['in_graph_ms_per_decode_step']:.2f} ms, " + ", ".join(
            f"{s} loop {out[f'host_{s}']['ms_per_decode_step']:.2f} ms" for s in HOST_LOOPS))
  print("in-graph faster than: " + ", ".join(
      f"{s} loop {out[f'host_{s}']['speedup_in_graph']:.2f}x" for s in HOST_LOOPS)
        + f"; shared prefix / repeated prompts: {out['speedup_shared_prefix_over_repeated']:.2f}x")
  return out


def _bench_model(args):
  """The dense benchmark model of `train` and `compile` (no MoE: its FLOPs depend on routing)."""
  from gspo_jax.models import config
  return config.ModelConfig(vocab_size=args.vocab, hidden=args.width, num_layers=args.layers,
                            num_heads=args.heads, num_kv_heads=args.kv_heads,
                            head_dim=args.width // args.heads, mlp_dim=4 * args.width,
                            rope_theta=1e4, scan_layers=args.scan,
                            dtype=args.dtype)


def bench_train(args) -> dict:
  """Update-step time and MFU. The machine is shared, so besides the peak sweep, each timed
  step is paired with a matmul timed just before it at the sweep's best size: the median of
  the per-pair ratios ("MFU, paired") compares the two under the same load."""
  peak = bench_peak(args)
  n = max(peak["rows"], key=lambda r: r["gflops"])["n"]
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(jnp.dot)
  out = {"peak_gflops": peak["peak_gflops"], "peak": peak, "paired_matmul_n": n,
         "rows": args.rows, "P": args.prompt_len, "T": args.new_tokens}
  for remat in args.remat:
    mcfg = dataclasses.replace(_bench_model(args), remat=remat)
    flops = update_flops(mcfg, args.rows, args.prompt_len, args.new_tokens)
    step, state, inputs = _bench.update_program(mcfg, args.rows, args.prompt_len, args.new_tokens)
    t0 = time.perf_counter()
    compiled = step.lower(state, *inputs).compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, *inputs)  # warm-up
    times, paired = [], []
    for _ in range(args.repeats):
      peak_now = 2 * n**3 / timed(matmul, a, a, repeats=3) / 1e9
      t0 = time.perf_counter()
      state, metrics = compiled(state, *inputs)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
      paired.append(flops["step"] / times[-1] / 1e9 / peak_now)
    sec = statistics.median(times)
    gflops = flops["step"] / sec / 1e9
    out.setdefault("model", dataclasses.asdict(mcfg))
    out.setdefault("flops", flops)
    out[f"remat_{remat}"] = {
        "seconds": sec, "all_seconds": times, "compile_seconds": compile_s,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "model_gflops_per_s": gflops, "mfu": gflops / out["peak_gflops"],
        "mfu_paired": statistics.median(paired), "all_mfu_paired": paired,
        "loss_finite": bool(np.isfinite(float(metrics["loss"])))}
  print(f"train: {flops['matmul_params'] / 1e6:.1f}M matmul params (hidden {args.width}, "
        f"{args.layers} layers, vocab {args.vocab}); update step on {args.rows} rows x "
        f"({args.prompt_len} prompt + {args.new_tokens} response) tokens = "
        f"{flops['step'] / 1e9:.0f} GFLOP (attention {flops['attention_share']:.0%} of forward)")
  print(f"{'remat':6} {'step s':>8} {'GFLOP/s':>9} {'MFU':>6} {'paired':>7} {'temp MiB':>9} "
        f"{'compile s':>10}")
  for remat in args.remat:
    r = out[f"remat_{remat}"]
    print(f"{remat:6} {r['seconds']:8.3f} {r['model_gflops_per_s']:9.1f} {r['mfu']:6.1%} "
          f"{r['mfu_paired']:7.1%} {r['temp_bytes'] / 2**20:9.1f} {r['compile_seconds']:10.2f}")
  print(f"MFU = model FLOP/s / the best matmul FLOP/s measured above "
        f"({out['peak_gflops']:.1f} GFLOP/s); paired: against a {n}x{n} matmul timed before each step")
  return out


def bench_prefix(args) -> dict:
  """The update step with `TrainConfig.share_prompts` off and on, on the same batch (B
  prompts x G responses): teacher forcing computes each prompt once per group instead of G
  times. Timed alternately (ABAB) so both see the same machine load."""
  mcfg = _bench_model(args)
  B, G, P, T = args.prompts, args.group, args.prompt_len, args.new_tokens
  R = B * G
  out = {"model": dataclasses.asdict(mcfg), "B": B, "G": G, "P": P, "T": T,
         # Token positions through the layers: G (P + T) per prompt without sharing.
         "positions_unshared": R * (P + T), "positions_shared": B * P + R * T}
  programs = {}
  for share in (False, True):
    step, state, inputs = _bench.update_program(mcfg, R, P, T, group=G, share_prompts=share)
    t0 = time.perf_counter()
    compiled = step.lower(state, *inputs).compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, *inputs)  # warm-up
    programs[share] = [compiled, state, inputs]
    out[f"share_{share}"] = {"compile_seconds": compile_s, "first_loss": float(metrics["loss"]),
                             "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                             "all_seconds": []}
  for _ in range(args.repeats):
    for share, prog in programs.items():
      compiled, state, inputs = prog
      t0 = time.perf_counter()
      state, metrics = compiled(state, *inputs)
      jax.block_until_ready(metrics)
      out[f"share_{share}"]["all_seconds"].append(time.perf_counter() - t0)
      prog[1] = state
  for share in (False, True):
    r = out[f"share_{share}"]
    r["seconds"] = statistics.median(r["all_seconds"])
  off, on = out["share_False"], out["share_True"]
  out["speedup"] = off["seconds"] / on["seconds"]
  out["speedup_paired"] = statistics.median(
      a / b for a, b in zip(off["all_seconds"], on["all_seconds"]))
  print(f"prefix: update step, {B} prompts x G={G}, {P} prompt + {T} response tokens, "
        f"hidden {args.width}, {args.layers} layers, vocab {args.vocab}; token positions "
        f"{out['positions_unshared']} -> {out['positions_shared']} "
        f"({out['positions_unshared'] / out['positions_shared']:.2f}x fewer)")
  print(f"{'share_prompts':14} {'step s':>8} {'temp MiB':>9} {'compile s':>10} {'first loss':>11}")
  for share in (False, True):
    r = out[f"share_{share}"]
    print(f"{str(share):14} {r['seconds']:8.3f} {r['temp_bytes'] / 2**20:9.1f} "
          f"{r['compile_seconds']:10.2f} {r['first_loss']:11.6f}")
  print(f"shared / unshared: {out['speedup']:.2f}x faster (paired {out['speedup_paired']:.2f}x)")
  return out


def bench_iteration(args) -> dict:
  """One GSPO iteration of `gspo_jax.train.loop` (addition task, no cold start), three ways, each
  from the same state over the same iterations: iteration 0 compiles, 1..N are timed.

    loop    `train.iterate`, as `train()` runs it (prepare overlaps the host's scoring, the
            next sampler is queued behind the update, metrics are fetched one iteration
            late). The headline `time_iteration` is its wall time over the N iterations / N,
            a mean; the median of the loop's own per-iteration `time_iteration` metric is
            reported beside it. Its `time_sample` runs from dispatch to the tokens on the
            host, so it includes what was left of the previous update.
    phases  the same programs one at a time, blocking after each: a diagnostic of where the
            time goes (sample; score = decode + Python rewards on the host; prepare = pi_old
            by teacher forcing; update = advantages + the minibatch scan), medians.
    fused   sample, token-id reward, prepare and update as one program (`gspo_jax.train.fused`),
            dispatched back to back; wall time / N, a mean.

  The phases also check the fused path's reward: how often the token-id exact match equals
  the task's text reward on the sampled responses."""
  import tempfile

  from gspo_jax.config import RolloutConfig, SFTConfig, TrainConfig
  from gspo_jax.models import config
  from gspo_jax.train.run import setup
  mcfg = config.tiny(vocab_size=32, hidden=args.width, mlp_dim=4 * args.width, num_heads=4,
                     num_kv_heads=2, head_dim=args.width // 4, num_layers=args.layers)
  cfg = TrainConfig(
      model=mcfg, num_minibatches=4, sft=SFTConfig(steps=0), share_prompts=args.share_prompts,
      rollout=RolloutConfig(prompts_per_iter=args.prompts, group_size=args.group,
                            max_new_tokens=args.new_tokens, max_prompt_len=8))
  N = args.iterations
  if N < 1:
    raise SystemExit("iteration: --iterations must be >= 1 (the timed iterations)")
  with tempfile.TemporaryDirectory() as run_dir:
    run = setup(cfg, run_dir)
    state0 = jax.tree.map(jnp.copy, run.state)  # every way starts from this state
    loop = _loop_iterations(run, N)
    run.state = jax.tree.map(jnp.copy, state0)
    phased = [_phased_iteration(run, it) for it in range(N + 1)]
    fused = _fused_iterations(run, jax.tree.map(jnp.copy, state0), N)
  median = {k: statistics.median(r[k] for r in phased[1:]) for k in ITERATION_PHASES}
  # Host work between the phases (drawing and encoding the prompts); a difference of
  # medians, so it can come out slightly negative.
  median["time_other"] = median["time_total"] - sum(median[k] for k in ITERATION_PHASES[:4])
  agree = [r.pop("token_reward_agrees") for r in phased[1:]]
  tokens = args.prompts * args.group * args.new_tokens
  out = {"model": dataclasses.asdict(mcfg), "rollout": dataclasses.asdict(cfg.rollout),
         "num_minibatches": cfg.num_minibatches, "share_prompts": cfg.share_prompts,
         "timed_iterations": N,
         "time_iteration": loop["time_iteration"],
         "time_iteration_statistic": f"mean: wall time of train.iterate over {N} iterations / {N}",
         "loop": loop, "phases_median": median, "phases_iterations": phased[1:], "fused": fused,
         "speedup_fused_over_loop": loop["time_iteration"] / fused["time_iteration"],
         "phases_total_over_loop": median["time_total"] / loop["time_iteration"],
         "token_reward_agreement": float(np.mean(np.concatenate(agree)))}
  print(f"iteration: addition, hidden {args.width}, {args.layers} layers; {args.prompts} prompts "
        f"x G={args.group}, up to {args.new_tokens} new tokens ({tokens} max), 4 minibatches, "
        f"share_prompts={cfg.share_prompts}; {N} iterations timed after a compiling one")
  print(f"loop (train.iterate): time_iteration {loop['time_iteration']:.4f} s (mean, wall / N; "
        f"median of its per-iteration metric {loop['time_iteration_median']:.4f} s; first "
        f"{loop['first_iteration_seconds']:.2f} s)")
  print(f"phases, blocking after each:\n{'phase':10} {'median s':>9} {'share':>6}")
  names = {"time_sample": "sample", "time_score": "score", "time_prepare": "prepare",
           "time_update": "update", "time_other": "other", "time_total": "total"}
  for k, name in names.items():
    print(f"{name:10} {median[k]:9.4f} {median[k] / median['time_total']:6.1%}")
  print(f"fused (one program): {fused['time_iteration']:.4f} s (mean, wall / N; first "
        f"{fused['first_iteration_seconds']:.2f} s)")
  print(f"fused / loop: {out['speedup_fused_over_loop']:.2f}x faster per iteration; blocking "
        f"phases / loop: {out['phases_total_over_loop']:.2f}x; token-id reward = text reward "
        f"on {out['token_reward_agreement']:.1%} of responses")
  return out


ITERATION_PHASES = ("time_sample", "time_score", "time_prepare", "time_update", "time_total")
LOOP_METRICS = ("time_sample", "time_score", "time_iteration", "tokens_per_s", "response_tokens")


def _loop_iterations(run, n: int) -> dict:
  """`train.iterate` for iteration 0 (compiles), then for iterations 1..n, timed whole."""
  from gspo_jax.train import loop as train
  rows = []
  keep = lambda step, m: rows.append({"step": step, **{k: float(m[k]) for k in LOOP_METRICS}})
  t0 = time.perf_counter()
  train.iterate(run, 0, 1, on_metrics=keep)
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  train.iterate(run, 1, n + 1, on_metrics=keep)  # returns once the last metrics are fetched
  wall = time.perf_counter() - t0
  return {"first_iteration_seconds": first, "seconds": wall, "time_iteration": wall / n,
          "time_iteration_median": statistics.median(r["time_iteration"] for r in rows[1:]),
          "iterations": rows[1:]}


def _phased_iteration(run, it: int) -> dict:
  """Iteration `it` as `rollout.rollout_step` + the update run it, blocking after each phase;
  also whether the token-id reward of the fused path equals the text reward, per response."""
  from gspo_jax.parallel import sharding
  from gspo_jax.tasks import text
  from gspo_jax.train import fused
  cfg, tok, mesh = run.cfg, run.tok, run.layout.mesh
  B, G, T = cfg.rollout.prompts_per_iter, cfg.rollout.group_size, cfg.rollout.max_new_tokens
  t0 = time.perf_counter()
  examples = run.task.train_batch(cfg.seed, it, B)
  prompts, lens = (sharding.feed(x, mesh, B)
                   for x in run.encode_prompts([e.prompt for e in examples]))
  t1 = time.perf_counter()
  rollout, _ = jax.block_until_ready(
      run.programs.sample(run.state.params, prompts, lens, run.state.key, it))
  t2 = time.perf_counter()
  tokens, mask = np.asarray(rollout.tokens_BxGxT), np.asarray(rollout.mask_BxGxT)
  texts = text.decode_completions(tok, tokens.reshape(B * G, T), mask.reshape(B * G, T))
  rewards, _, _ = run.task.score_batch([e for e in examples for _ in range(G)], texts)
  rewards_BxG = np.asarray(rewards, np.float32).reshape(B, G)
  t3 = time.perf_counter()
  batch = jax.block_until_ready(run.programs.prepare(run.state.params, None, rollout, prompts,
                                                     lens))
  t4 = time.perf_counter()
  run.state, metrics = run.programs.update(run.state, batch,
                                           sharding.feed(rewards_BxG, mesh, B))
  jax.block_until_ready(metrics)
  t5 = time.perf_counter()
  answer, answer_lens = text.encode_answers(tok, [e.answer for e in examples], T)
  token_rewards = fused.exact_match_reward(jnp.asarray(tokens), jnp.asarray(answer),
                                           jnp.asarray(answer_lens), tok.eos_id)
  return {"time_sample": t2 - t1, "time_score": t3 - t2, "time_prepare": t4 - t3,
          "time_update": t5 - t4, "time_total": t5 - t0,
          "token_reward_agrees": (np.asarray(token_rewards) == rewards_BxG).ravel()}


def _fused_iterations(run, state, n: int) -> dict:
  """The fused program for iteration 0 (compiles), then iterations 1..n dispatched back to
  back (the host draws and encodes the next prompts and answers while the device runs),
  timed whole."""
  from gspo_jax.tasks import text
  from gspo_jax.train import fused
  step = fused.make_fused_iteration(run)
  cfg = run.cfg

  def inputs(it: int):
    examples = run.task.train_batch(cfg.seed, it, cfg.rollout.prompts_per_iter)
    prompts, lens = run.encode_prompts([e.prompt for e in examples])
    answer, answer_lens = text.encode_answers(run.tok, [e.answer for e in examples],
                                              cfg.rollout.max_new_tokens)
    return prompts, lens, answer, answer_lens

  t0 = time.perf_counter()
  state, metrics = jax.block_until_ready(step(state, *inputs(0)))
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  for it in range(1, n + 1):
    state, metrics = step(state, *inputs(it))  # the state is donated
  jax.block_until_ready((state, metrics))
  wall = time.perf_counter() - t0
  return {"first_iteration_seconds": first, "seconds": wall, "time_iteration": wall / n}


def _compile_seconds(jitted, *args) -> tuple[float, float]:
  """(trace + lower seconds, XLA compile seconds)."""
  t0 = time.perf_counter()
  lowered = jitted.lower(*args)
  t1 = time.perf_counter()
  lowered.compile()
  return t1 - t0, time.perf_counter() - t1


def bench_compile(args) -> dict:
  """Compile time of the update step and of the sampler vs the number of layers (fixed
  width), for the unrolled model and the scanned one (`ModelConfig.scan_layers`)."""
  from flax import nnx

  from gspo_jax.models import transformer
  from gspo_jax.rollout import sampling
  R, P, T = args.rows, args.prompt_len, args.new_tokens
  scfg = sampling.SamplerConfig(group_size=2, max_new_tokens=T, eos_id=args.vocab - 1,
                                max_prompt_len=P)
  prompts, lens = jnp.ones((R // 2, P), jnp.int32), jnp.full((R // 2,), P, jnp.int32)
  rows = []
  # The first compile of a process also pays one-off costs (LLVM set-up): warm up on a
  # 1-layer model and discard it.
  for scan, layers, warm_up in ([(args.modes[0], 1, True)] +
                                [(s, n, False) for s in args.modes for n in args.layers]):
    mcfg = _bench_model(argparse.Namespace(**{**vars(args), "layers": layers,
                                              "scan": scan == "scan", "dtype": "float32"}))
    row = {"mode": scan, "layers": layers}
    if "update" in args.programs:
      step, state, inputs = _bench.update_program(mcfg, R, P, T)
      row["update_lower_seconds"], row["update_compile_seconds"] = _compile_seconds(
          step, state, *inputs)
    if "sampler" in args.programs:
      graphdef, params = nnx.split(transformer.create(mcfg))
      # The pure sampler a run's `programs.sample` compiles, here on one device.
      program = jax.jit(functools.partial(sampling.sample, graphdef, cfg=scfg))
      row["sampler_lower_seconds"], row["sampler_compile_seconds"] = _compile_seconds(
          program, params, prompts, lens, jax.random.key(0))
    if warm_up:
      continue
    rows.append(row)
    print(f"{scan:8} {layers:3d} layers: " + " | ".join(
        f"{p} lower {row[p + '_lower_seconds']:6.2f} s compile {row[p + '_compile_seconds']:6.2f} s"
        for p in args.programs), flush=True)
  out = {"model": {**dataclasses.asdict(mcfg), "num_layers": args.layers}, "rows": rows}
  for mode in args.modes:
    mine = [r for r in rows if r["mode"] == mode]
    lo, hi = mine[0], mine[-1]
    total = lambda r, p: r[f"{p}_lower_seconds"] + r[f"{p}_compile_seconds"]
    for p in args.programs:
      out[f"{mode}_{p}_growth_{hi['layers']}_over_{lo['layers']}"] = total(hi, p) / total(lo, p)
  for k, v in out.items():
    if "growth" in k:
      print(f"{k}: {v:.2f}x (lower + compile)")
  return out


def nnx_params(model):
  from flax import nnx
  return nnx.state(model, nnx.Param)


def _add_model_args(p, *, width: int, layers: int, heads: int, kv_heads: int, vocab: int):
  """The dense benchmark model's shape (`_bench_model`), with this subcommand's defaults."""
  p.add_argument("--width", type=int, default=width)
  p.add_argument("--layers", type=int, default=layers)
  p.add_argument("--heads", type=int, default=heads)
  p.add_argument("--kv-heads", type=int, default=kv_heads)
  p.add_argument("--vocab", type=int, default=vocab)
  p.add_argument("--scan", action="store_true", help="ModelConfig.scan_layers=True")
  p.add_argument("--dtype", default="float32",
                 help="ModelConfig.dtype, the compute dtype (parameters stay float32)")


def _add_peak_args(p, sizes):
  p.add_argument("--sizes", type=int, nargs="+", default=sizes, help="square matmul sizes")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=None,
                      help="directory for the JSON record (default: runs/results/, or "
                           "experiments/results/ with --record)")
  _results.add_record_arg(parser)
  sub = parser.add_subparsers(dest="cmd")
  sub.add_parser("all", help="every measurement at its quick size (the default)")
  p = sub.add_parser("peak", help="matmul throughput")
  _add_peak_args(p, [512, 1024, 2048])
  p.add_argument("--repeats", type=int, default=5)
  p = sub.add_parser("train", help="update step: time, model FLOP/s, MFU against peak")
  _add_peak_args(p, [512, 1024, 2048])
  _add_model_args(p, width=512, layers=6, heads=8, kv_heads=4, vocab=8192)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=96)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--remat", nargs="+", default=["none"], choices=REMAT_CHOICES,
                 help="ModelConfig.remat values to measure, one update step each")
  p.add_argument("--repeats", type=int, default=3)
  p = sub.add_parser("logprobs", help="lean vs plain token log-probs")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--tokens", type=int, default=1024)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--vocab", type=int, default=151936)  # Qwen3's vocabulary
  p.add_argument("--chunk", type=int, default=128)
  p.add_argument("--repeats", type=int, default=3)
  p = sub.add_parser("sampler", help="in-graph group sampler vs a host-driven loop")
  p.add_argument("--prompts", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=512)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--scan", action="store_true", help="ModelConfig.scan_layers=True")
  p.add_argument("--repeats", type=int, default=3)
  p = sub.add_parser("prefix", help="update step with and without prompt sharing")
  p.add_argument("--prompts", type=int, default=4)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=256)
  p.add_argument("--new-tokens", type=int, default=64)
  _add_model_args(p, width=256, layers=4, heads=8, kv_heads=4, vocab=2048)
  p.add_argument("--repeats", type=int, default=5)
  p = sub.add_parser("iteration", help="one GSPO iteration: the loop end to end, by phase, fused")
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--new-tokens", type=int, default=5)
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--iterations", type=int, default=5,
                 help="timed iterations, after one compiling iteration")
  p.add_argument("--share-prompts", action="store_true", help="TrainConfig.share_prompts=True")
  p = sub.add_parser("compile", help="compile time vs number of layers")
  p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 28])
  p.add_argument("--modes", nargs="+", default=list(LAYER_MODES), choices=LAYER_MODES)
  p.add_argument("--programs", nargs="+", default=["update", "sampler"],
                 choices=("update", "sampler"))
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--vocab", type=int, default=1024)
  p.add_argument("--rows", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=16)
  _bench_long.add_parser(sub)
  _bench_decode.add_parser(sub)
  _bench_bandwidth.add_parser(sub)
  _bench_matmul.add_parser(sub)
  return parser


REMAT_CHOICES = ("none", "full", "dots")
LAYER_MODES = ("unrolled", "scan")
BENCHES = {"peak": bench_peak, "train": bench_train, "logprobs": bench_logprobs,
           "sampler": bench_sampler, "prefix": bench_prefix, "iteration": bench_iteration,
           "compile": bench_compile, "long": _bench_long.bench_long,
           "decode": _bench_decode.bench_decode, "bandwidth": _bench_bandwidth.bench_bandwidth,
           "matmul": _bench_matmul.bench_matmul}
# `all`: each measurement at a size that keeps the whole run to a few minutes on 2 CPU cores.
QUICK = {
    "peak": ["peak", "--sizes", "512", "1024", "--repeats", "3"],
    "train": ["train", "--layers", "4", "--sizes", "512", "1024", "--repeats", "2"],
    "logprobs": ["logprobs", "--batch", "2", "--tokens", "512", "--width", "128", "--chunk", "64",
                 "--repeats", "1"],
    "sampler": ["sampler", "--repeats", "2"],
    "prefix": ["prefix", "--prompt-len", "128", "--repeats", "3"],
    "iteration": ["iteration", "--iterations", "3"],
    "compile": ["compile", "--layers", "2", "8", "--programs", "update"],
}


def run_one(argv: list[str]) -> dict:
  """Parse one subcommand's arguments, run it, and return its record (with load averages:
  the machine is shared, and a loaded machine explains a slow figure)."""
  args = build_parser().parse_args(argv)
  load_before = os.getloadavg()
  result = BENCHES[args.cmd](args)
  return {"command": "python -m experiments.benchmark " + " ".join(argv), "args": vars(args),
          "machine": machine(), "load_average_before": load_before,
          "load_average_after": os.getloadavg(), "result": result}


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser().parse_args(argv)
  if args.cmd not in (None, "all"):
    print("wrote", write(args.cmd, run_one(argv), _results.out_path(args)))
    return
  out_args = argv[:argv.index("all")] if "all" in argv else argv
  t0 = time.perf_counter()
  records = {}
  for name, quick in QUICK.items():
    print(f"\n== {name}: python -m experiments.benchmark {' '.join(quick)}", flush=True)
    records[name] = run_one(out_args + quick)
  total = time.perf_counter() - t0
  print(f"\nall benchmarks: {total:.0f} s")
  record = {"command": "python -m experiments.benchmark " + " ".join(argv),
            "seconds": total, "machine": machine(), "records": records}
  print("wrote", write("all", record, _results.out_path(args)))


if __name__ == "__main__":
  main()
