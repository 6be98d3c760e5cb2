"""What LoRA costs and saves on a config: the update's state in bytes, and the sampler's and
the update's seconds, full fine-tuning beside LoRA, on the same rollout batch.

    python -m experiments.lora_cost --config configs/addition_tiny_lora.py [--repeats 5]
    python -m experiments.lora_cost --config configs/addition_tiny_lora.py:smoke --quick
    python -m experiments.lora_cost --shapes qwen3_8b --rank 16    # bytes only, nothing run
    python -m experiments.lora_cost --dot                         # int8 vs float matmul

Both runs are set up from the config (the full one with `lora.rank = 0`), with no cold start
(the comparison is of programs, not of what they learned). Bytes: every array of the
`TrainState`'s parameters and optimiser state, and for LoRA the frozen base held beside
it. Seconds: the median of `--repeats` calls after a warm-up (`_bench.timed`), of the run's
own `sample` program (the LoRA one merges the adapters into the base inside it, once per
call) and `update` program (its minibatch steps; LoRA's merges inside the loss). Written to
runs/results/benchmark_lora_cost.json (`--out DIR`: elsewhere).

`--shapes MODEL` counts the same bytes for a real model's shapes without building it
(`jax.eval_shape`): full fine-tuning with float32 master parameters and Adam, against LoRA
with the base frozen in bfloat16 (it takes no optimiser step, so it needs no float32 copy)
or in int8 (`lora.base_dtype`: the dense weights int8 with float32 scales per output channel,
the rest bfloat16) and float32 adapters and Adam. Activations and temporaries are not counted.

`--dot` times one 512 x 2048 by 2048 x 2048 product three ways on this machine's device:
float32, float32 by an int8 weight dequantised in the same program (what an int8 base's
programs do), and XLA's int8 x int8 -> int32 dot (which `lora.base_dtype = "int8"` does
not use; docs/lora.md says why). Median of `--repeats` calls, the three interleaved.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _bench
from gspo_jax.config import SFTConfig, TrainConfig
from gspo_jax.lora import adapters as lora
from gspo_jax.lora import quant as lora_quant
from gspo_jax.lora.adapters import LoRAConfig
from gspo_jax.parallel import sharding
from gspo_jax.train import run as R
from gspo_jax.train.collect import rollout_step
from gspo_jax.utils import configlib


def measure(cfg: TrainConfig, run_dir: str, repeats: int) -> dict:
  """Bytes and seconds of one run set up from `cfg` in `run_dir`."""
  run = R.setup(cfg, run_dir)
  r = rollout_step(run, run.state.params, run.state.key, 0)
  rows, group = r.rewards_BxG.shape
  rewards = sharding.feed(np.random.default_rng(0).normal(size=(rows, group)).astype(np.float32),
                          run.layout.mesh, rows)
  prompts, lens = r.batch.prompts_BxP, r.batch.prompt_lens_B
  sample = lambda: run.programs.sample(run.state.params, prompts, lens, run.state.key, 0)
  # The update donates its state: each call gets a fresh copy (copied outside the timing).
  states = [jax.tree.map(jnp.copy, run.state) for _ in range(repeats + 1)]
  update = lambda: run.programs.update(states.pop(), r.batch, rewards)
  out = {"param_bytes": lora.num_bytes(run.state.params),
         "opt_bytes": lora.num_bytes(run.state.opt_state),
         "frozen_base_bytes": 0 if run.frozen is None else lora.num_bytes(run.frozen.params),
         "sample_s": _bench.timed(sample, repeats=repeats),
         "update_s": _bench.timed(update, repeats=repeats)}
  out["update_state_bytes"] = out["param_bytes"] + out["opt_bytes"]
  return out


# Hugging Face config.json of Qwen/Qwen3-8B (hidden_size, intermediate_size, ...).
SHAPES = {"qwen3_8b": dict(vocab_size=151936, hidden=4096, num_layers=36, num_heads=32,
                           num_kv_heads=8, head_dim=128, mlp_dim=12288, tie_embeddings=False),
          "qwen3_0_6b": dict(vocab_size=151936, hidden=1024, num_layers=28, num_heads=16,
                             num_kv_heads=8, head_dim=128, mlp_dim=3072, tie_embeddings=True)}


def state_bytes(model: str, rank: int, alpha: float) -> dict:
  """Bytes of the update's state for `SHAPES[model]`, full fine-tuning and LoRA."""
  from flax import nnx

  from gspo_jax.models.config import ModelConfig
  from gspo_jax.models.transformer import Transformer
  from gspo_jax.train.optim import OptimConfig, make_optimizer
  tx = make_optimizer(OptimConfig())
  shapes = lambda dtype: nnx.split(nnx.eval_shape(lambda: Transformer(
      ModelConfig(**SHAPES[model], param_dtype=dtype), rngs=nnx.Rngs(0))), nnx.Param)[1]
  full, base = shapes("float32"), shapes("bfloat16")
  adapters = lora.adapter_shapes(full, LoRAConfig(rank=rank, alpha=alpha))
  opt = lambda params: lora.num_bytes(jax.eval_shape(tx.init, params))
  return {"model": model, "rank": rank,
          "full": {"param_bytes": lora.num_bytes(full), "opt_bytes": opt(full)},
          "lora": {"param_bytes": lora.num_bytes(adapters), "opt_bytes": opt(adapters),
                   "frozen_base_bytes": lora.num_bytes(base),
                   "frozen_base_int8_bytes": lora.num_bytes(
                       lora_quant.abstract(base, lora.dense_weights(base)))}}


def dot_seconds(repeats: int) -> dict:
  """Median seconds of the three products of `--dot` (module docstring), interleaved."""
  x = jax.random.normal(jax.random.key(0), (512, 2048))
  w = jax.random.normal(jax.random.key(1), (2048, 2048))
  q = lambda a: jnp.clip(jnp.round(a * 20), -127, 127).astype(jnp.int8)
  scale = jnp.full((1, 2048), 0.05, jnp.float32)  # one per output channel
  fns = {"float32": (jax.jit(lambda a, b: a @ b), (x, w)),
         "dequantised_int8": (jax.jit(lambda a, b, s: a @ (b.astype(jnp.float32) * s)),
                              (x, q(w), scale)),
         "int8_int8_int32": (jax.jit(lambda a, b: jax.lax.dot(
             a, b, preferred_element_type=jnp.int32)), (q(x), q(w)))}
  times = {name: [] for name in fns}
  for f, args in fns.values():
    f(*args).block_until_ready()
  for _ in range(repeats):
    for name, (f, args) in fns.items():
      t0 = time.perf_counter()
      f(*args).block_until_ready()
      times[name].append(time.perf_counter() - t0)
  return {name: float(np.median(t)) for name, t in times.items()}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/addition_tiny_lora.py")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="2 repeats (tests)")
  p.add_argument("--out", default="runs/results")
  p.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                 help="bytes only, for a real model's shapes (nothing is built or run)")
  p.add_argument("--rank", type=int, default=16, help="with --shapes")
  p.add_argument("--alpha", type=float, default=32.0, help="with --shapes")
  p.add_argument("--dot", action="store_true", help="time int8 and float matmuls only")
  args = p.parse_args(argv)
  if args.dot:
    record = {"dot_s": dot_seconds(2 if args.quick else args.repeats),
              "machine": _bench.machine()}
    print(", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in record["dot_s"].items()))
    _bench.write("lora_int8_dot", record, args.out)
    return record
  if args.shapes:
    record = state_bytes(args.shapes, args.rank, args.alpha)
    gib = lambda b: f"{b / 2**30:,.2f} GiB"
    full, low = record["full"], record["lora"]
    print(f"{args.shapes}: full fine-tuning {gib(full['param_bytes'])} float32 parameters + "
          f"{gib(full['opt_bytes'])} Adam = {gib(full['param_bytes'] + full['opt_bytes'])}")
    print(f"LoRA r={args.rank}: {gib(low['param_bytes'])} adapters + {gib(low['opt_bytes'])} "
          f"Adam = {gib(low['param_bytes'] + low['opt_bytes'])}, frozen bfloat16 base "
          f"{gib(low['frozen_base_bytes'])} (int8 base: {gib(low['frozen_base_int8_bytes'])})")
    _bench.write(f"lora_state_{args.shapes}", record, args.out)
    return record
  cfg = configlib.load_config(args.config)
  if not cfg.lora.rank:
    raise SystemExit(f"{args.config}: lora.rank is 0; give a LoRA config")
  cfg = dataclasses.replace(cfg, sft=SFTConfig(steps=0))
  repeats = 2 if args.quick else args.repeats
  record = {"config": args.config, "lora": dataclasses.asdict(cfg.lora),
            "machine": _bench.machine()}
  with tempfile.TemporaryDirectory() as d:  # one tokenizer, trained once, for both runs
    record["full"] = measure(dataclasses.replace(cfg, lora=LoRAConfig()), d, repeats)
    record["lora"] = measure(cfg, d, repeats)
  full, low = record["full"], record["lora"]
  record["update_state_ratio"] = low["update_state_bytes"] / full["update_state_bytes"]
  path = _bench.write("lora_cost", record, args.out)
  kib = lambda b: f"{b / 2**10:,.1f} KiB"
  print(f"update state: full {kib(full['update_state_bytes'])}, LoRA "
        f"{kib(low['update_state_bytes'])} (+ frozen base {kib(low['frozen_base_bytes'])})")
  print(f"sample: full {full['sample_s'] * 1e3:.1f} ms, LoRA {low['sample_s'] * 1e3:.1f} ms; "
        f"update: full {full['update_s'] * 1e3:.1f} ms, LoRA {low['update_s'] * 1e3:.1f} ms")
  print(f"written to {path}")
  return record


if __name__ == "__main__":
  main()
