"""What the benchmark scripts share (`benchmark.py` and its `long` and `decode`
subcommands in `_bench_long.py` and `_bench_decode.py`, `device_check.py`, `peer_tunix.py`):
the machine's description, a timer, the measured matmul peak (`bench_peak`), the JSON writer, the decode benchmarks' shape flags, and
one update step's program and model FLOPs. It imports no script, so the scripts import it
rather than each other."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


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


def add_shape_args(p) -> None:
  """The decode benchmarks' shape (`long` and `decode`): B prompts of P tokens x G, the
  tiny model's width, layers and vocabulary."""
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--vocab", type=int, default=4096)


def update_flops(mcfg, rows: int, prompt_len: int, new_tokens: int) -> dict:
  """Model FLOPs of one GSPO update step (forward + backward) on R rows of S = P + T tokens.

  The update recomputes teacher-forced log-probs over every row's prompt and response
  (`teacher_forcing.response_logprobs`), so the forward pass runs on all S positions, and the
  unembedding only on the T response positions (the lean log-prob path). Per layer, with
  D hidden, N query heads, C kv heads, H head_dim, M mlp width:
    matmul weights  W_layer = D*N*H (q) + 2*D*C*H (k, v) + N*H*D (o) + 3*D*M (SwiGLU)
    forward         2 * R*S * L*W_layer  +  2 * R*T * D*V  +  L * 4 * R * S^2 * N*H
  where the last term is q k^T and p v over all S x S query/key pairs (the mask is applied
  to scores, nothing is skipped). Backward = 2 x forward (gradients with respect to inputs
  and to weights), so the step is 3 x forward: the usual 6 * params * tokens plus
  12 * L * R * S^2 * N*H for attention. Recomputation (the lean path's checkpointed logits,
  remat) is not counted: these are model FLOPs, so MFU = model FLOP/s / peak FLOP/s.
  """
  c = mcfg
  L, D, N, C, H, M, V = (c.num_layers, c.hidden, c.num_heads, c.num_kv_heads, c.head_dim,
                         c.mlp_dim, c.vocab_size)
  S, T, R = prompt_len + new_tokens, new_tokens, rows
  w_layer = D * N * H + 2 * D * C * H + N * H * D + 3 * D * M
  fwd_layers = 2 * R * S * L * w_layer
  fwd_unembed = 2 * R * T * D * V
  fwd_attention = L * 4 * R * S * S * N * H
  forward = fwd_layers + fwd_unembed + fwd_attention
  return {"matmul_params": L * w_layer + D * V, "forward": forward, "step": 3 * forward,
          "attention_share": fwd_attention / forward}


def random_batch(mcfg, rows: int, prompt_len: int, new_tokens: int, *, group: int,
                  seed: int = 0):
  """(a `step.Batch` of random rollout rows, rewards_BxG): B = rows / group prompts of G =
  group responses (full-length prompts, every token counted), random rewards (the update
  turns them into group-normalised advantages)."""
  from gspo_jax.train import step
  rng = np.random.default_rng(seed)
  B, G, P, T = rows // group, group, prompt_len, new_tokens
  batch = step.Batch(
      prompts_BxP=jnp.asarray(rng.integers(0, mcfg.vocab_size, (B, P)), jnp.int32),
      prompt_lens_B=jnp.full((B,), P, jnp.int32),
      tokens_BxGxT=jnp.asarray(rng.integers(0, mcfg.vocab_size, (B, G, T)), jnp.int32),
      mask_BxGxT=jnp.ones((B, G, T), jnp.float32),
      old_logp_BxGxT=jnp.asarray(rng.normal(-8.0, 1.0, (B, G, T)), jnp.float32))
  return batch, jnp.asarray(rng.normal(0.0, 1.0, (B, G)), jnp.float32)


def update_program(mcfg, rows: int, prompt_len: int, new_tokens: int, group: int = 2,
                   share_prompts: bool = False):
  """(jitted `step.update` with the state donated, TrainState, (Batch, rewards_BxG)) for
  one minibatch of `rows` rows: rows / group prompts of `group` responses."""
  from flax import nnx

  from gspo_jax.config import RolloutConfig, TrainConfig
  from gspo_jax.models import transformer
  from gspo_jax.train import optim, programs, step
  cfg = TrainConfig(model=mcfg, num_minibatches=1, share_prompts=share_prompts,
                    rollout=RolloutConfig(prompts_per_iter=rows // group, group_size=group,
                                          max_new_tokens=new_tokens, max_prompt_len=prompt_len))
  graphdef, params = nnx.split(transformer.create(mcfg), nnx.Param)
  tx = optim.make_optimizer(cfg.optim)
  state = step.TrainState(params=params, opt_state=tx.init(params),
                          step=jnp.zeros((), jnp.int32), key=jax.random.key(0))
  update = jax.jit(functools.partial(step.update, graphdef=graphdef, tx=tx,
                                     cfg=programs.step_config(cfg)),
                   donate_argnums=(0,))
  return update, state, random_batch(mcfg, rows, prompt_len, new_tokens, group=group)


def bench_peak(args) -> dict:
  """float32 matmuls (the peak the update's MFU is taken against), and beside them bfloat16
  inputs with a float32 result (`preferred_element_type`: where the CPU has AMX-BF16 or
  AVX512-BF16 units, XLA:CPU uses them) and bfloat16 in and out."""
  rows = []
  bf16_acc32 = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  for n in args.sizes:
    a = jnp.ones((n, n), jnp.float32)
    b = a.astype(jnp.bfloat16)
    f = jax.jit(jnp.dot)
    sec = timed(f, a, a, repeats=args.repeats)
    sec_acc32 = timed(bf16_acc32, b, b, repeats=args.repeats)
    sec_bf16 = timed(f, b, b, repeats=args.repeats)
    flop = 2 * n**3
    rows.append({"n": n, "seconds": sec, "gflops": flop / sec / 1e9,
                 "bf16_f32acc_gflops": flop / sec_acc32 / 1e9,
                 "bf16_gflops": flop / sec_bf16 / 1e9})
    print(f"matmul {n:5d}x{n:<5d} f32  {rows[-1]['gflops']:8.1f} GFLOP/s   bf16 -> f32 "
          f"{rows[-1]['bf16_f32acc_gflops']:8.1f}   bf16 -> bf16 {rows[-1]['bf16_gflops']:8.1f}")
  return {"peak_gflops": max(r["gflops"] for r in rows), "rows": rows}
