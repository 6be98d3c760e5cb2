"""`benchmark.py decode`: the sampler's time per decode step at 64 / 256 / 1,024 new tokens,
this checkout against the sampler of an earlier commit, alternated in one process.

Variants, each a compiled `sampling.sample` of the same model and prompts (EOS = the last
id, rarely drawn, so nearly every response runs all T steps):
  baseline     the sampler of `--baseline` (a commit), imported from `git archive` of it
               under another package name; skipped with --baseline "" or without git
  phased       this checkout (decode phases with doubling caches, `decode_windows`)
  one_phase    this checkout with decode_window = T: one phase over the full cache
  bf16_cache   this checkout with cache_dtype = "bfloat16" (float32 compute)
ms per decode step = (seconds - seconds at T = 1) / (steps - 1), the medians of
--repeats calls taken in turn (variant after variant, T after T) so that the machine's load
falls on all of them alike. Every variant's tokens and log-probs are compared with the
phased sampler's; the compiled program's temporary memory (the KV cache lives there) and
its compile seconds are recorded. The variants of this checkout also record how far their
log-probs are from teacher forcing's on their own tokens (`response_logprobs`, float32):
the bfloat16 cache's tolerance at this shape.

Rows that ended: `--rows` also times the phased sampler at the largest T with fewer
prompts (B G rows each): what a decode step would cost if finished rows were removed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _bench, _results

VARIANTS = ("baseline", "phased", "one_phase", "bf16_cache")


def add_parser(sub) -> None:
  p = sub.add_parser("decode", help="time per decode step vs new tokens, against a baseline")
  p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256, 1024])
  _bench.add_shape_args(p)
  p.add_argument("--scan", action="store_true", help="ModelConfig.scan_layers=True")
  p.add_argument("--baseline", default="8ccb752",
                 help="commit whose sampler to compare with ('' = none)")
  p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
  p.add_argument("--rows", type=int, nargs="*", default=[4, 2],
                 help="fewer prompts to time the phased sampler with at the largest T")
  p.add_argument("--repeats", type=int, default=3)


def baseline_package(commit: str):
  """gspo_jax as of `commit`, importable next to this checkout's (as gspo_jax_<commit>)."""
  name = "gspo_jax_" + re.sub(r"\W", "_", commit)
  tar = subprocess.run(["git", "-C", _results.ROOT, "archive", commit, "gspo_jax"], check=True,
                       capture_output=True).stdout
  where = tempfile.mkdtemp(prefix="bench_decode_")
  tarfile.open(fileobj=io.BytesIO(tar)).extractall(where, filter="data")
  os.rename(os.path.join(where, "gspo_jax"), os.path.join(where, name))
  for folder, _, files in os.walk(os.path.join(where, name)):
    for f in (f for f in files if f.endswith(".py")):
      path = os.path.join(folder, f)
      text = open(path).read()
      open(path, "w").write(re.sub(r"\bgspo_jax\b", name, text))
  # Loaded from its folder rather than through sys.path: its submodules resolve through the
  # package's own __path__, and nothing else this process imports can come from there.
  package = os.path.join(where, name)
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(package, "__init__.py"), submodule_search_locations=[package])
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def _model(args, pkg):
  """(graphdef, params) of the benchmark model built by `pkg` (gspo_jax or the baseline's):
  the same seed, so the same weights."""
  from flax import nnx
  config = importlib.import_module(pkg.__name__ + ".models.config")
  transformer = importlib.import_module(pkg.__name__ + ".models.transformer")
  mcfg = config.tiny(vocab_size=args.vocab, hidden=args.width, num_layers=args.layers,
                     mlp_dim=4 * args.width, num_heads=4, num_kv_heads=2,
                     head_dim=args.width // 4, scan_layers=args.scan)
  return nnx.split(transformer.create(mcfg))


def _program(args, pkg, model, variant: str, B: int, T: int):
  """(compiled sampler, its arguments, compile seconds) of one variant."""
  # The sampler's module: gspo_jax.rollout.sampling, or gspo_jax.sampling in a baseline
  # commit from before the package was split into subpackages.
  try:
    sampling = importlib.import_module(pkg.__name__ + ".rollout.sampling")
  except ModuleNotFoundError:
    sampling = importlib.import_module(pkg.__name__ + ".sampling")
  graphdef, params = model
  extra = {"one_phase": {"decode_window": T}, "bf16_cache": {"cache_dtype": "bfloat16"}}
  scfg = sampling.SamplerConfig(group_size=args.group, max_new_tokens=T, eos_id=args.vocab - 1,
                                max_prompt_len=args.prompt_len, **extra.get(variant, {}))
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, args.vocab, (B, args.prompt_len)), jnp.int32)
  inputs = (params, prompts, jnp.full((B,), args.prompt_len, jnp.int32), jax.random.key(0))
  t0 = time.perf_counter()
  compiled = jax.jit(functools.partial(sampling.sample, graphdef, cfg=scfg)).lower(
      *inputs).compile()
  return compiled, inputs, time.perf_counter() - t0


def _teacher_gap(model, inputs, rollout) -> dict:
  """max and mean |sampler - teacher-forced| log-prob over the rollout's counted tokens."""
  from flax import nnx

  from gspo_jax.rollout.teacher_forcing import response_logprobs
  graphdef, _ = model
  params, prompts, lens, _ = inputs
  teacher = jax.jit(lambda p: response_logprobs(nnx.merge(graphdef, p), prompts, lens,
                                                rollout.tokens_BxGxT)[0])
  mask = np.asarray(rollout.mask_BxGxT) > 0
  gap = np.abs(np.asarray(teacher(params)) - np.asarray(rollout.logp_BxGxT))[mask]
  return {"max_abs_logp_diff_teacher": float(gap.max()),
          "mean_abs_logp_diff_teacher": float(gap.mean())}


def bench_decode(args) -> dict:
  import gspo_jax
  variants = [v for v in args.variants if v != "baseline" or args.baseline]
  if "phased" not in variants:
    raise SystemExit("benchmark.py decode: --variants needs 'phased', the reference of the "
                     "token and log-prob comparisons")
  pkgs = {v: gspo_jax for v in variants}
  if "baseline" in variants:
    pkgs["baseline"] = baseline_package(args.baseline)
  models = {pkg.__name__: _model(args, pkg) for pkg in set(pkgs.values())}
  case = lambda v, b, T: _program(args, pkgs[v], models[pkgs[v].__name__], v, b, T)
  T_max, B = max(args.new_tokens), args.prompts
  cases = {(v, B, T): case(v, B, T) for v in variants for T in sorted({1, *args.new_tokens})}
  cases.update({("phased", b, T): case("phased", b, T) for b in args.rows for T in (1, T_max)})
  outs = {k: jax.block_until_ready(c(*inputs)) for k, (c, inputs, _) in cases.items()}
  times = {k: [] for k in cases}
  for _ in range(args.repeats):
    for k, (compiled, inputs, _) in cases.items():
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*inputs))
      times[k].append(time.perf_counter() - t0)
  rows = []
  for (v, b, T), (compiled, _, compile_s) in cases.items():
    if T == 1:
      continue
    sec, out = statistics.median(times[(v, b, T)]), outs[(v, b, T)]
    ref = outs[("phased", b, T)]
    steps = int(out.steps)
    rows.append({
        "variant": v, "prompts": b, "rows": b * args.group, "T": T, "steps": steps,
        "seconds": sec, "seconds_T1": statistics.median(times[(v, b, 1)]),
        "ms_per_decode_step": 1e3 * (sec - statistics.median(times[(v, b, 1)])) / max(steps - 1, 1),
        "compile_seconds": compile_s,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "tokens_equal_phased": bool(np.array_equal(out.tokens_BxGxT, ref.tokens_BxGxT)),
        "max_abs_logp_diff_phased": float(np.max(np.abs(np.asarray(out.logp_BxGxT)
                                                        - np.asarray(ref.logp_BxGxT)))),
        "all_seconds": times[(v, b, T)],
        **(_teacher_gap(models[gspo_jax.__name__], cases[(v, b, T)][1], out)
           if v in ("phased", "bf16_cache") and b == B else {})})
  print(f"{'variant':11} {'rows':>4} {'T':>5} {'steps':>5} {'s':>7} {'ms/step':>8} "
        f"{'temp MiB':>8} {'compile s':>9} {'same tokens':>11} {'|dlogp|':>8} {'teacher max':>11} "
        f"{'mean':>8}")
  for r in sorted(rows, key=lambda r: (r["rows"] != B * args.group, r["T"], r["variant"])):
    print(f"{r['variant']:11} {r['rows']:4d} {r['T']:5d} {r['steps']:5d} {r['seconds']:7.3f} "
          f"{r['ms_per_decode_step']:8.2f} {r['temp_bytes'] / 2**20:8.1f} "
          f"{r['compile_seconds']:9.2f} {str(r['tokens_equal_phased']):>11} "
          f"{r['max_abs_logp_diff_phased']:8.1e} {r.get('max_abs_logp_diff_teacher', np.nan):11.1e} "
          f"{r.get('mean_abs_logp_diff_teacher', np.nan):8.1e}")
  return {"shape": {"B": B, "G": args.group, "P": args.prompt_len, "hidden": args.width,
                    "layers": args.layers, "vocab": args.vocab, "scan_layers": args.scan},
          "baseline_commit": args.baseline, "rows": rows}
