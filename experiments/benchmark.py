"""Benchmarks. Each subcommand prints a table and writes JSON under experiments/results/.

    python experiments/benchmark.py peak       # measured matmul FLOP/s (the ceiling)
    python experiments/benchmark.py logprobs   # lean vs plain token log-probs: memory, time
    python experiments/benchmark.py sampler    # in-graph group sampler vs a host-driven loop

Figures are measured in one process; ratios compare runs of the same process on the
same input. Machines are noisy: rerun before trusting a small difference.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def _host_loop_sampler(model, cfg):
  """Baseline: a jitted prefill and a jitted one-token step driven from Python, checking
  on the host after every token whether all responses ended (as HF-style loops do)."""
  from flax import nnx

  from gspo_jax import sampling
  from gspo_jax.models.transformer import KVCache

  @nnx.jit
  def prefill(model, prompts, lens, key):
    B, P = prompts.shape
    pos = jnp.broadcast_to(jnp.arange(P), (B, P))
    valid = pos < lens[:, None]
    out = model(prompts, pos, valid)
    last = jnp.take_along_axis(out.hidden_BxSxD, (lens - 1)[:, None, None], 1)[:, 0]
    logits = jnp.broadcast_to(model.logits(last)[:, None], (B, cfg.group_size, model.cfg.vocab_size))
    token, logp, _ = sampling._pick(logits, key, cfg)
    return token, logp, KVCache.from_prefill(out, valid, cfg.group_size, cfg.max_new_tokens)

  @nnx.jit
  def step(model, token, done, positions, cache, key):
    hidden, cache = model.decode(token, positions, cache)
    token, logp, _ = sampling._pick(model.logits(hidden), key, cfg)
    token = jnp.where(done, cfg.pad_id, token)  # same bookkeeping as the in-graph sampler
    return token, done | (token == cfg.eos_id), cache

  def run(prompts, lens, key):
    token, logp, cache = prefill(model, prompts, lens, jax.random.fold_in(key, 0))
    tokens, done = [token], token == cfg.eos_id
    for t in range(1, cfg.max_new_tokens):
      if bool(jnp.all(done)):  # host round trip every token
        break
      positions = jnp.broadcast_to(lens[:, None] + t - 1, token.shape)
      token, done, cache = step(model, token, done, positions, cache, jax.random.fold_in(key, t))
      tokens.append(token)
    return jnp.stack(tokens, -1)

  return run


def bench_sampler(args) -> dict:
  from gspo_jax import sampling
  from gspo_jax.models import config, transformer

  mcfg = config.tiny(vocab_size=args.vocab, hidden=args.width, num_layers=args.layers,
                     mlp_dim=4 * args.width, num_heads=4, num_kv_heads=2, head_dim=args.width // 4)
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
  host = _host_loop_sampler(model, scfg)
  t0 = time.perf_counter()
  host_tokens = jax.block_until_ready(host(prompts, lens, key))
  host_first_s = time.perf_counter() - t0
  # Same keys, same computation: the baseline must produce the same tokens.
  same = np.array_equal(np.asarray(host_tokens), np.asarray(rollout.tokens_BxGxT)[..., :steps])
  host_s = timed(lambda: host(prompts, lens, key), repeats=args.repeats)
  # Prefill once per prompt and share its cache (G responses) vs repeat each prompt G times.
  rep_cfg = dataclasses.replace(scfg, group_size=1)
  rep_prompts, rep_lens = jnp.repeat(prompts, G, 0), jnp.repeat(lens, G)
  repeated = timed(lambda: sampling.sample_groups(model, rep_prompts, rep_lens, key, rep_cfg),
                   repeats=args.repeats)
  tokens = B * G * steps
  out = {"model": dataclasses.asdict(mcfg), "B": B, "P": P, "G": G, "T": T, "steps": steps,
         "host_loop_tokens_equal_in_graph": same,
         "params": sum(x.size for x in jax.tree.leaves(nnx_params(model))),
         "in_graph_seconds": in_graph, "in_graph_tokens_per_s": tokens / in_graph,
         "in_graph_first_call_seconds": compile_s,
         "host_loop_seconds": host_s, "host_loop_tokens_per_s": tokens / host_s,
         "host_loop_first_call_seconds": host_first_s,
         "speedup_in_graph_over_host_loop": host_s / in_graph,
         "repeated_prompt_seconds": repeated,
         "speedup_shared_prefix_over_repeated": repeated / in_graph}
  print(f"sampler: {out['params'] / 1e6:.2f}M-param model (hidden {args.width}, {args.layers} layers, "
        f"vocab {args.vocab}); B={B} prompts x G={G}, prompt {P} tokens, {steps} of max {T} new "
        f"tokens; host loop output identical: {same}")
  print(f"{'variant':34} {'seconds':>8} {'tokens/s':>10} {'first call s':>13}")
  print(f"{'in-graph (shared prefix)':34} {in_graph:8.3f} {tokens / in_graph:10.0f} {compile_s:13.2f}")
  print(f"{'host loop of jitted 1-token steps':34} {host_s:8.3f} {tokens / host_s:10.0f} "
        f"{host_first_s:13.2f}")
  print(f"{'in-graph, prompt repeated G times':34} {repeated:8.3f} {tokens / repeated:10.0f}")
  print(f"in-graph / host loop: {out['speedup_in_graph_over_host_loop']:.2f}x faster; "
        f"shared prefix / repeated prompts: {out['speedup_shared_prefix_over_repeated']:.2f}x faster")
  return out


def nnx_params(model):
  from flax import nnx
  return nnx.state(model, nnx.Param)


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
  p = sub.add_parser("sampler", help="in-graph group sampler vs a host-driven loop")
  p.add_argument("--prompts", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=256)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  result = {"peak": bench_peak, "logprobs": bench_logprobs, "sampler": bench_sampler}[args.cmd](args)
  record = {"command": "python experiments/benchmark.py " + " ".join(argv or sys.argv[1:]),
            "args": vars(args),
            "machine": machine(), "result": result}
  print("wrote", write(args.cmd, record, args.out))


if __name__ == "__main__":
  main()
