"""LoRA: low-rank adapters trained on a frozen base (Hu et al. 2021, arXiv 2106.09685).

Each adapted weight W, viewed as a matrix from its input dimensions I to its output
dimensions O, is used as

    W' = W + (alpha / r) * A @ B,     A: (I, r),  B: (r, O)

with B = 0 at the start, so W' = W exactly (W + 0 is W bit for bit) and the adapted
policy starts as the base. Only A and B are trained; the base is never differentiated, held
in an optimiser or donated.

Shapes (ours, `gspo_jax.models`): the adapters keep the weight's own axes on their side,
so they take the weight's logical axes there (and so its sharding, `sharding.PARAM_RULES`);
the rank axis is replicated. With `model.scan_layers` both lead with the `layers` axis.

  target  weight (in -> out)         lora_a          lora_b
  q       (D, N, H)  D -> N*H        (D, r)          (r, N, H)
  k, v    (D, C, H)  D -> C*H        (D, r)          (r, C, H)
  o       (N, H, D)  N*H -> D        (N, H, r)       (r, D)
  gate,up (D, F)     D -> F          (D, r)          (r, F)
  down    (F, D)     F -> D          (F, r)          (r, D)

MoE expert weights (E, D, F) are refused (`check_model`): only dense MLPs and attention
are adapted. How W' is formed: `merge` adds the product to the base weight, once per
program call (the sampler merges once per rollout; the update merges inside the loss, so
the gradient reaches A and B through the sum). A base stored in int8 (`base_dtype`,
`gspo_jax.lora.quant`) is dequantised by `merge` first. Dropout on the adapter's input is
refused (`LoRAConfig`: GSPO's ratios must be exactly 1 at theta = theta_old).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax.lora import quant
from gspo_jax.models.config import ModelConfig

Array = jax.Array

# target -> (the weight's path inside a layer, how many of its leading axes are inputs)
TARGETS: dict[str, tuple[tuple[str, str], int]] = {
    "q": (("attn", "q"), 1), "k": (("attn", "k"), 1), "v": (("attn", "v"), 1),
    "o": (("attn", "o"), 2),
    "gate": (("mlp", "gate"), 1), "up": (("mlp", "up"), 1), "down": (("mlp", "down"), 1),
}
MLP_TARGETS = ("gate", "up", "down")
COLD_STARTS = ("full", "adapters")
A, B = "lora_a", "lora_b"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """The `lora` config group. rank r = 0: off (every parameter is trained).

  alpha: the adapters' scale is alpha / r (PEFT's `lora_alpha`). targets: which weights of
  every layer get adapters (`TARGETS`). dropout: must be 0 (the message below says why).
  base_dtype: "" (the base in the model's own dtype) or "int8" (`gspo_jax.lora.quant`).
  cold_start: what the cold start (`sft.steps` > 0) trains: "full", the whole model, which
  then becomes the frozen base (adapters from B = 0); or "adapters", the adapters on the
  frozen initial base, which RL then goes on training (`gspo_jax.lora.run`)."""
  rank: int = 0
  alpha: float = 32.0
  targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
  dropout: float = 0.0
  base_dtype: str = ""
  cold_start: str = "full"

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
      raise ValueError(f"lora.rank must be an int >= 1 (0 = LoRA off); got {self.rank!r}")
    if self.base_dtype not in quant.BASE_DTYPES:
      raise ValueError(f"lora.base_dtype must be one of {quant.BASE_DTYPES} ('' = the "
                       f"model's own dtype; nf4 is not built); got {self.base_dtype!r}")
    if self.cold_start not in COLD_STARTS:
      raise ValueError(f"lora.cold_start must be one of {COLD_STARTS}; got {self.cold_start!r}")
    if not self.rank:
      named = [f"lora.{k} = {v!r}" for k, v, off in (("base_dtype", self.base_dtype, ""),
                                                     ("cold_start", self.cold_start, "full"))
               if v != off]
      if named:
        raise ValueError(f"{', '.join(named)} needs lora.rank > 0 (only a LoRA run has a "
                         "frozen base and adapters)")
      return
    if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
      raise ValueError(f"lora.alpha must be > 0 (the scale is alpha / rank); got {self.alpha!r}")
    targets = tuple(self.targets)
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown or len(set(targets)) != len(targets):
      raise ValueError(f"lora.targets must name distinct weights of {', '.join(TARGETS)}; got "
                       f"{targets!r}" + (f" ({', '.join(map(repr, unknown))} unknown)"
                                         if unknown else ""))
    if self.dropout != 0:
      # GSPO's ratio (pi_theta / pi_old)^(1/|y|) must be exactly 1 at theta = theta_old (the
      # first minibatch step): pi_old is the deterministic policy (prepare, the sampler), and
      # a dropped-out pi_theta is another function, whose ratio noise would exceed GSPO's
      # clip range (3e-4 / 4e-4) from the first step. The only loss without a ratio here is
      # the cold start's, which trains the whole model, not adapters.
      raise ValueError(f"lora.dropout must be 0: a dropped-out policy is not the policy that "
                       f"sampled, so GSPO's importance ratios would not be 1 at theta = "
                       f"theta_old (docs/lora.md); got {self.dropout!r}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def check_model(lc: LoRAConfig, model: ModelConfig) -> None:
  """ValueError naming the field when `lc` cannot adapt `model`: a rank above a target's
  smaller side (its in or out width), or MLP targets on a model whose MLPs are MoE experts."""
  if not lc.rank:
    return
  moe = [t for t in lc.targets if t in MLP_TARGETS and model.num_moe_layers]
  if moe:
    raise ValueError(f"lora.targets {moe} would adapt MoE expert weights (model.num_experts = "
                     f"{model.num_experts}): experts are not supported; adapt the attention "
                     f"(q, k, v, o) only")
  D, N, C, H, F = model.hidden, model.num_heads, model.num_kv_heads, model.head_dim, model.mlp_dim
  sides = {"q": (D, N * H), "k": (D, C * H), "v": (D, C * H), "o": (N * H, D),
           "gate": (D, F), "up": (D, F), "down": (F, D)}
  for t in lc.targets:
    if lc.rank > min(sides[t]):
      raise ValueError(f"lora.rank = {lc.rank} is larger than target {t!r}, a "
                       f"{sides[t][0]} x {sides[t][1]} weight (model.hidden, heads x head_dim, "
                       f"mlp_dim): at most {min(sides[t])}")


def dense_weights(params) -> dict[tuple, int]:
  """Every weight of a kind `TARGETS` names (adapted or not), path -> its number of input
  axes: what an int8 base quantises (`quant.quantize`)."""
  names = {where: n for where, n in TARGETS.values()}
  return {path: names[tuple(path[-2:])] for path, _ in nnx.to_flat_state(params)
          if tuple(path[-2:]) in names}


def weight_paths(params, lc: LoRAConfig) -> list[tuple]:
  """The state paths of the weights `lc` adapts, in state order."""
  names = {TARGETS[t][0] for t in lc.targets}
  return [path for path, _ in nnx.to_flat_state(params) if tuple(path[-2:]) in names]


def _inputs(path) -> int:
  return next(n for (where, n) in TARGETS.values() if where == tuple(path[-2:]))


def adapter_shapes(params, lc: LoRAConfig) -> nnx.State:
  """The adapters of `params` as abstract nnx.Param variables (jax.ShapeDtypeStruct
  values) with their logical axes: A takes the weight's input axes, B its output axes
  (`layers` on both for a scanned model). float32 at least, whatever the base's dtype: an
  adapter is a trained parameter (the float32-master reason of `models.config`)."""
  flat = dict(nnx.to_flat_state(params))
  out = {}
  for path in weight_paths(params, lc):
    var = flat[path]
    w, axes = var.get_value(), var.get_metadata()["logical_axes"]
    lead = int(axes[0] == "layers")
    cut = lead + _inputs(path)
    dtype = jnp.promote_types(w.dtype, jnp.float32)
    a_shape = (*w.shape[:cut], lc.rank)
    b_shape = (*w.shape[:lead], lc.rank, *w.shape[cut:])
    out[(*path, A)] = nnx.Param(jax.ShapeDtypeStruct(a_shape, dtype),
                                logical_axes=(*axes[:cut], None))
    out[(*path, B)] = nnx.Param(jax.ShapeDtypeStruct(b_shape, dtype),
                                logical_axes=(*axes[:lead], None, *axes[cut:]))
  return nnx.from_flat_state(out)


def init_adapters(abstract: nnx.State, key: Array) -> nnx.State:
  """A ~ U(-1/sqrt(I), 1/sqrt(I)) (PEFT's default, I the input width), B = 0. Traceable:
  run under `jax.jit` with the adapters' shardings as out_shardings."""
  flat = list(nnx.to_flat_state(abstract))
  out = {}
  for i, (path, var) in enumerate(flat):
    s = var.get_value()
    if path[-1] == B:
      value = jnp.zeros(s.shape, s.dtype)
    else:
      lead = int(var.get_metadata()["logical_axes"][0] == "layers")
      bound = math.prod(s.shape[lead:-1]) ** -0.5
      value = jax.random.uniform(jax.random.fold_in(key, i), s.shape, s.dtype, -bound, bound)
    out[path] = var.replace(value)
  return nnx.from_flat_state(out)


def merge(base: nnx.State, adapters: nnx.State, scale: float) -> nnx.State:
  """The base's parameters with every adapted weight W replaced by W + scale * A @ B (in the
  adapters' dtype, float32 or wider); the others are the base's arrays, untouched. An int8
  base is dequantised first (`quant.dequantize`: float32 weights)."""
  flat = dict(nnx.to_flat_state(quant.dequantize(base)))
  pairs = dict(nnx.to_flat_state(adapters))
  for path in dict.fromkeys(p[:-1] for p in pairs):  # in state order: the same program always
    var = flat[path]
    a, b = pairs[(*path, A)].get_value(), pairs[(*path, B)].get_value()
    w = var.get_value()
    flat[path] = var.replace(w.astype(a.dtype) + scale * _delta_for(a, b, w))
  return nnx.from_flat_state(flat)


def _delta_for(a: Array, b: Array, w: Array) -> Array:
  """A @ B reshaped to `w` (the weight fixes where the layers axis is)."""
  lead = a.ndim + b.ndim - 2 - w.ndim
  ins, outs = a.shape[lead:-1], b.shape[lead + 1:]
  a2 = a.reshape(*a.shape[:lead], math.prod(ins), a.shape[-1])
  b2 = b.reshape(*b.shape[:lead], b.shape[lead], math.prod(outs))
  return jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(w.shape)


def num_bytes(tree: Any) -> int:
  """Bytes of every array (or ShapeDtypeStruct) in `tree`."""
  arrays = (jax.Array, jax.ShapeDtypeStruct, np.ndarray)
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
             if isinstance(x, arrays))


@dataclasses.dataclass(frozen=True)
class Adapted:
  """The model of a LoRA program: the structure, the frozen base's parameters (arguments
  of the program, traced with it) and the adapters' scale. The train step takes it in
  place of a graphdef (`model_of`): `bind(adapters)` is the base with them merged in."""
  graphdef: Any
  base: Any
  scale: float

  def bind(self, adapters):
    return nnx.merge(self.graphdef, merge(self.base, adapters, self.scale))


def model_of(graphdef, params):
  """The model of `params`: `nnx.merge(graphdef, params)`; when `graphdef` is an `Adapted`
  (a LoRA program), `params` are the adapters, merged into its frozen base, so a gradient
  with respect to `params` reaches the adapters only."""
  if isinstance(graphdef, Adapted):
    return graphdef.bind(params)
  return nnx.merge(graphdef, params)
