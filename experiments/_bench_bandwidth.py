"""`benchmark.py bandwidth`: the decode bound. The machine's memory bandwidth measured in this
process (as `peak` measures the matmul bound), and the sampler's decode step against it.

Bandwidth: jitted passes over a float32 array of `--gib` GiB, each timed (median of
`--repeats` after a warm-up): `read` (a sum: the array read once), `scale` (x * c: read
once, written once) and `copy+` (x + y: two reads, one write). GB/s = bytes moved / seconds.

Decode: the rollout sampler (`sampling.sample`, as `programs.sampler_program` runs it on one
device: with `rollout.sampler_dtype` the parameters cast inside the program; the KV cache
of each prompt shared by its G responses) on one model at `--shape` (default SmolLM2-135M:
30 layers, d 576, 9 / 3 heads of 64, MLP 1,536, vocab 49,152, tied embeddings), B prompts x
G responses, P prompt tokens, T new tokens, EOS never drawn. Variants: float32; the
bfloat16 sampler (`rollout.sampler_dtype=bfloat16`: parameters and activations cast inside
the program); float32 weights with bfloat16 matmul inputs accumulated in float32
(`model.matmul_dtype`); each with a bfloat16 KV cache (`rollout.kv_cache_dtype`). ms per decode step
= (seconds at T - seconds at T = 1) / (T - 1). Bytes a decode step must read at least: every
weight once (the embedding table too: tied, it is the unembedding) plus the KV cache up to
the current position, the prompt's part once per prompt and each response's own part once
(averaged over the T steps). Achieved GB/s = those bytes / the step's seconds; the ratio to
the measured bandwidth says how far the step is from the memory bound.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import _bench

SHAPES = {"smollm2": dict(vocab_size=49152, hidden=576, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, mlp_dim=1536, tie_embeddings=True),
          "tiny": dict(vocab_size=4096, hidden=256, num_layers=2, num_heads=8, num_kv_heads=4,
                       head_dim=32, mlp_dim=768)}
# (rollout.sampler_dtype, rollout.kv_cache_dtype, model.matmul_dtype)
VARIANTS = {"float32": ("", "", ""), "float32_bf16_cache": ("", "bfloat16", ""),
            "bf16_sampler": ("bfloat16", "", ""), "bf16_sampler_bf16_cache": ("bfloat16", "bfloat16", ""),
            "bf16_matmul": ("", "", "bfloat16"), "bf16_matmul_bf16_cache": ("", "bfloat16", "bfloat16")}


def add_parser(sub) -> None:
  p = sub.add_parser("bandwidth", help="memory bandwidth, and the decode step against it")
  p.add_argument("--gib", type=float, default=1.0, help="size of the bandwidth arrays")
  p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
  p.add_argument("--repeats", type=int, default=5)


def bandwidth(gib: float, repeats: int) -> dict:
  n = int(gib * 2**30) // 4
  x = jnp.arange(n, dtype=jnp.float32) * 1e-9
  y = x + 1.0
  nbytes = 4 * n
  passes = {"read": (jax.jit(jnp.sum), (x,), nbytes),
            "scale": (jax.jit(lambda a: a * 1.5), (x,), 2 * nbytes),
            "copy+": (jax.jit(lambda a, b: a + b), (x, y), 3 * nbytes)}
  out = {}
  for name, (fn, args, moved) in passes.items():
    sec = _bench.timed(fn, *args, repeats=repeats)
    out[name] = {"bytes": moved, "seconds": sec, "gb_per_s": moved / sec / 1e9}
    print(f"bandwidth {name:6}: {out[name]['gb_per_s']:6.1f} GB/s ({moved / 2**30:.1f} GiB "
          f"in {sec * 1e3:.1f} ms)")
  out["gb_per_s"] = max(v["gb_per_s"] for v in out.values())
  return out


def _step_bytes(mcfg, param_bytes: int, cache_item: int, B: int, G: int, P: int, T: int) -> float:
  """Bytes one decode step reads at least, averaged over T steps: the weights once, the
  prompt's cached keys/values once per prompt, each response's own up to its position."""
  per_position = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * cache_item
  mean_own = (T - 1) / 2
  return param_bytes + per_position * (B * P + B * G * mean_own)


def bench_bandwidth(args) -> dict:
  from gspo_jax.models import config, transformer
  from gspo_jax.rollout import sampling
  from gspo_jax.train import programs

  bw = bandwidth(args.gib, args.repeats)
  mcfg = config.ModelConfig(rope_theta=1e6, **SHAPES[args.shape])
  graphdef, params = nnx.split(transformer.create(mcfg), nnx.Param)
  B, G, P, T = args.prompts, args.group, args.prompt_len, args.new_tokens
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, mcfg.vocab_size, (B, P)), jnp.int32)
  lens = jnp.full((B,), P, jnp.int32)
  cases = {}
  for v in args.variants:
    dtype, cache, mm = VARIANTS[v]
    vcfg = dataclasses.replace(mcfg, matmul_dtype=mm)
    gd = programs._cast_graphdef(vcfg, dtype) if dtype else nnx.graphdef(nnx.eval_shape(
        lambda vcfg=vcfg: transformer.Transformer(vcfg, rngs=nnx.Rngs(0))))
    cast = (lambda p, d=dtype: jax.tree.map(lambda x: x.astype(d), p)) if dtype else (lambda p: p)
    for t in (1, T):
      scfg = sampling.SamplerConfig(group_size=G, max_new_tokens=t, eos_id=mcfg.vocab_size,
                                    max_prompt_len=P, cache_dtype=cache)
      fn = lambda p, pr, ln, k, gd=gd, cast=cast, scfg=scfg: sampling.sample(
          gd, cast(p), pr, ln, k, cfg=scfg)
      t0 = time.perf_counter()
      compiled = jax.jit(fn).lower(params, prompts, lens, jax.random.key(0)).compile()
      cases[v, t] = (compiled, time.perf_counter() - t0)
  times = {k: [] for k in cases}
  for _ in range(args.repeats + 1):   # alternated; the first round is a warm-up
    for k, (compiled, _) in cases.items():
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(params, prompts, lens, jax.random.key(0)))
      times[k].append(time.perf_counter() - t0)
  rows = []
  for v in args.variants:
    dtype, cache, _ = VARIANTS[v]
    item = jnp.dtype(dtype or mcfg.param_dtype).itemsize
    pbytes = sum(x.size for x in jax.tree.leaves(params)) * item
    cache_item = jnp.dtype(cache or dtype or mcfg.dtype).itemsize
    sec_T, sec_1 = statistics.median(times[v, T][1:]), statistics.median(times[v, 1][1:])
    step_s = (sec_T - sec_1) / (T - 1)
    need = _step_bytes(mcfg, pbytes, cache_item, B, G, P, T)
    rows.append({"variant": v, "seconds": sec_T, "seconds_T1": sec_1, "ms_per_step": 1e3 * step_s,
                 "param_bytes": pbytes, "step_bytes": need, "gb_per_s": need / step_s / 1e9,
                 "of_bandwidth": need / step_s / 1e9 / bw["gb_per_s"],
                 "compile_seconds": cases[v, T][1], "all_seconds": times[v, T][1:]})
    r = rows[-1]
    print(f"decode {v:24}: {r['ms_per_step']:7.1f} ms/step, {need / 2**20:7.1f} MiB/step -> "
          f"{r['gb_per_s']:5.1f} GB/s = {r['of_bandwidth']:.0%} of {bw['gb_per_s']:.1f}")
  return {"bandwidth": bw, "shape": {"name": args.shape, **dataclasses.asdict(mcfg)},
          "B": B, "G": G, "P": P, "T": T, "decode": rows}
