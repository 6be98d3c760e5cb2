"""What a planned run costs per chip: the chips' published figures, analytic FLOPs and HBM
bytes of each program, interconnect bytes read from the compiled HLO, and the roofline.

Shapes: the package legend (docs/shapes.md); here B prompts, G responses each, P prompt
and T response tokens (the run's maxima: the sampler's early exit is not counted), D
hidden, L layers, V vocabulary.

Why analytic FLOPs: XLA's `cost_analysis()` counts a loop's body once, so a scanned model
reports one layer (2.96 TFLOP for a 233 TFLOP update). The counts here follow the
programs as written:

    per token and layer  2 * (matmul parameters) + 4 * Hq * hd * keys   (QK^T and PV)
    per scored token     2 * D * V                                       (the log-probs)
    sample   prefill B*P tokens over P keys; T decode steps of B*G rows over P + T/2 keys
             (the phased cache's mean)
    prepare  one teacher-forced pass per log-prob it computes (pi_old recomputed, pi_ref):
             B*P prompt tokens once, B*G*T response tokens over P + T keys
    update   the same pass, x3 for the backward (x4 with cfg.remat="full")

HBM bytes count weights, optimiser state and the KV cache, not activations: a lower bound.
Interconnect bytes per chip are each collective's bytes on the wire for a ring over its
group of n chips (all-reduce 2S(n-1)/n, all-gather and all-to-all S(n-1)/n of the result S,
reduce-scatter S(n-1), collective-permute S), weighted by loop trip counts like
`plan.collective_bytes`.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Chip:
  """Published per-chip figures (Cloud TPU system-architecture pages, 2026): HBM, bf16 peak,
  HBM bandwidth, and the interconnect's all-reduce bandwidth per chip (the pod's all-reduce
  bandwidth over its chips: half the bidirectional ICI figure on v5e / v5p / v6e).
  `devices_per_chip`: JAX devices per chip in a topology (v4 shows each TensorCore)."""
  hbm_gib: float
  bf16_tflops: float
  hbm_gbs: float
  ici_gbs: float
  devices_per_chip: int = 1


CHIPS = {"v4": Chip(32, 275, 1200, 1.1e6 / 4096, devices_per_chip=2),
         "v5e": Chip(16, 197, 819, 200),
         "v5p": Chip(95, 459, 2765, 600),
         "v6e": Chip(32, 918, 1640, 400)}


# Local accelerators by JAX's device_kind, for `--topology local`: published dense bf16
# peak and HBM bandwidth (NVIDIA's H100 SXM and H200 data sheets); HBM from the device.
LOCAL_PEAKS = {"NVIDIA H100 80GB HBM3": (989, 3350), "NVIDIA H200": (989, 4800)}


def local_chip(devices) -> Chip:
  """This process's devices as a Chip: HBM from the backend's memory statistics, peaks from
  `LOCAL_PEAKS` (zero, and no roofline, for a kind not listed, such as a CPU)."""
  stats = devices[0].memory_stats() or {}
  tflops, gbs = LOCAL_PEAKS.get(devices[0].device_kind, (0, 0))
  return Chip(stats.get("bytes_limit", 0) / 2 ** 30, tflops, gbs, ici_gbs=0)


def _matmul_params_per_token(m) -> int:
  """Weights each token multiplies by, summed over layers (MoE: the router and K experts)."""
  attn = m.hidden * m.num_heads * m.head_dim * 2 + 2 * m.hidden * m.num_kv_heads * m.head_dim
  total = 0
  for layer in range(m.num_layers):
    if m.is_moe_layer(layer):
      total += attn + m.hidden * m.num_experts + m.experts_per_token * 3 * m.hidden * m.moe_mlp_dim
    else:
      total += attn + 3 * m.hidden * m.mlp_dim
  return total


def _forward(m, tokens: float, keys: float, scored: float) -> float:
  """FLOPs of a forward pass over `tokens` tokens attending to `keys` keys each, with the
  log-probs (or logits) of `scored` of them."""
  attention = 4 * m.num_heads * m.head_dim * keys * m.num_layers
  return tokens * (2 * _matmul_params_per_token(m) + attention) + scored * 2 * m.hidden * m.vocab_size


def teacher_forcing_flops(m, B: int, G: int, P: int, T: int, share_prompts: bool = True) -> float:
  """One teacher-forced pass (`teacher_forcing.response_logprobs`)."""
  if G > 1 and share_prompts:
    return _forward(m, B * P, P, 0) + _forward(m, B * G * T, P + T, B * G * T)
  return _forward(m, B * G * (P + T), P + T, B * G * T)


def _passes(cfg, m) -> tuple[int, int]:
  """(forward-pass equivalents of a training step: 3, or 4 with full remat; the teacher-
  forced passes `prepare` runs: pi_old recomputed, pi_ref)."""
  backward = 4 if m.remat == "full" else 3
  passes = int(cfg.old_logp == "recompute" or cfg.routing != "free") + int(bool(cfg.loss.kl_coef))
  return backward, passes


def program_flops(cfg, m) -> dict[str, float]:
  """FLOPs of each program for one call, summed over chips (see the module docstring)."""
  r = cfg.rollout
  B, G, P, T = r.sampled_prompts, r.group_size, r.max_prompt_len, r.max_new_tokens
  backward, passes = _passes(cfg, m)
  tf = teacher_forcing_flops(m, B, G, P, T, cfg.share_prompts)

  def sampler(rows_B: int, group: int) -> float:
    prefill = _forward(m, rows_B * P, P, rows_B)
    return prefill + T * _forward(m, rows_B * group, P + T / 2, rows_B * group)

  out = {"init": 0.0, "sample": sampler(B, G), "prepare": passes * tf, "update": backward * tf,
         "greedy": sampler(cfg.eval_size or B, 1)}
  if cfg.sft.steps:
    out["sft"] = backward * teacher_forcing_flops(m, cfg.sft.batch_size, 1, P, T)
  return out


def program_hbm_bytes(cfg, m, mesh_shape: dict[str, int], param_count: int) -> dict[str, float]:
  """Per chip: weight reads per pass (gathered over fsdp and expert, split over tensor; a
  MoE layer's experts split over expert), optimiser state read and written per minibatch,
  and the sampler's per-step weight shard and KV cache reads. Activations are not counted."""
  r = cfg.rollout
  B, G, P, T = r.sampled_prompts, r.group_size, r.max_prompt_len, r.max_new_tokens
  data, fsdp, expert, tensor = (mesh_shape.get(a, 1)
                                for a in ("data", "fsdp", "expert", "tensor"))
  # Expert weights stay split over `expert` when a pass uses them.
  experts = m.num_moe_layers * 3 * m.num_experts * m.hidden * m.moe_mlp_dim if expert > 1 else 0
  compute = jnp.dtype(m.dtype).itemsize
  master = jnp.dtype(m.param_dtype).itemsize
  sampler_item = jnp.dtype(r.sampler_dtype or m.param_dtype).itemsize
  cache_item = jnp.dtype(r.kv_cache_dtype or r.sampler_dtype or m.dtype).itemsize
  weights_pass = (param_count - experts + experts / expert) * compute / tensor
  backward, passes = _passes(cfg, m)
  optimiser = param_count / (fsdp * expert * tensor) * master * 3 * 2    # params, mu, nu: read + write
  kv_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * cache_item

  def sampler(rows_B: int, group: int) -> float:
    rows_per_chip = rows_B * group / (data * fsdp * expert)
    step = param_count * sampler_item / (fsdp * expert * tensor) + rows_per_chip * kv_per_token * (
        P / group + T / 2) / tensor
    return weights_pass + T * step

  out = {"init": param_count * master / (fsdp * expert * tensor), "sample": sampler(B, G),
         "prepare": passes * weights_pass,
         "update": cfg.num_minibatches * (backward * weights_pass + optimiser),
         "greedy": sampler(cfg.eval_size or B, 1)}
  if cfg.sft.steps:
    out["sft"] = backward * weights_pass + optimiser
  return out


def group_size(op_text: str, devices: int) -> int:
  """Chips in each replica group of a collective, from its HLO text."""
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", op_text)
  if mesh:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)))
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=", op_text)
  if iota:
    return int(iota.group(1).split(",")[-1])
  listed = re.search(r"replica_groups=\{\{([\d,]*)\}", op_text)
  if listed:
    return len(listed.group(1).split(","))
  return devices


def wire_bytes(kind: str, result_bytes: int, n: int) -> float:
  """Bytes one chip sends for a collective whose result is `result_bytes`, over n chips."""
  if n <= 1:
    return 0.0
  return {"all-reduce": 2 * result_bytes * (n - 1) / n,
          "all-gather": result_bytes * (n - 1) / n,
          "all-to-all": result_bytes * (n - 1) / n,
          "reduce-scatter": result_bytes * (n - 1),
          "collective-permute": float(result_bytes)}[kind]


def roofline(flops_total: float, hbm_bytes: float, ici_bytes: float, chip: Chip,
             devices: int) -> dict[str, float | str]:
  """Seconds each resource needs at its peak, per chip, and the one that binds."""
  per_device = lambda x: x / chip.devices_per_chip
  if not chip.bf16_tflops:  # a device whose peaks are not known here
    return {}
  times = {"compute_s": flops_total / devices / (per_device(chip.bf16_tflops) * 1e12),
           "hbm_s": hbm_bytes / (per_device(chip.hbm_gbs) * 1e9),
           "ici_s": ici_bytes / (per_device(chip.ici_gbs) * 1e9) if chip.ici_gbs else 0.0}
  bound = max(times, key=times.get)
  return {**times, "time_s": times[bound], "bound": bound.removesuffix("_s")}
