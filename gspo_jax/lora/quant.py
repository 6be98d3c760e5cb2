"""A LoRA run's frozen base stored in int8 (`lora.base_dtype = "int8"`): the dense weights
of every layer (attention q/k/v/o and the dense MLP's gate/up/down, adapted or not) are
held as int8 with one float32 scale per output channel; everything else (embeddings,
norms, MoE experts, the output head) stays as the model holds it.

Quantisation (symmetric absmax, per output channel): for a weight W seen as a matrix from
its input axes I to its output axes O,

    scale_O = max_I |W| / 127,     q = round(W / scale_O) in [-127, 127] (int8),
    W ~ dequantize = q * scale_O   (float32; |W - q * scale_O| <= scale_O / 2 elementwise)

A weight's entry in the state, at its path, becomes a pair at (path, "int8") (W's shape and
logical axes, so W's sharding) and (path, "scale") (W's shape without its input axes; the
`layers` axis kept in a scanned model). The programs dequantise inside themselves (`lora.merge`
for the adapted policy, `dequantize` for pi_ref), so only the int8 copy is stored between
calls; in a program the dequantised float32 weights exist as the merged ones do.

This module knows nothing of LoRA's targets: `quantize` is given each weight's number of
input axes (`lora.dense_weights`); `dequantize` reads it from the pair's shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

QUANT, SCALE = "int8", "scale"
# lora.base_dtype: "" = the model's own parameter dtype (nothing quantised).
BASE_DTYPES = ("", "int8")
_QMAX = 127.0


def _lead(var) -> int:
  return int(tuple(var.get_metadata()["logical_axes"])[0] == "layers")


def quantize(params: nnx.State, inputs: dict[tuple, int]) -> nnx.State:
  """`params` with each weight at a path of `inputs` (path -> its number of input axes)
  replaced by its int8 values and per-output-channel scales (the module docstring).
  Traceable: run under `jax.jit` with the quantised state's shardings (`abstract`)."""
  flat = dict(nnx.to_flat_state(params))
  out = {}
  for path, var in flat.items():
    if path not in inputs:
      out[path] = var
      continue
    w, axes = var.get_value().astype(jnp.float32), tuple(var.get_metadata()["logical_axes"])
    lead = _lead(var)
    cut = lead + inputs[path]
    scale = jnp.max(jnp.abs(w), axis=tuple(range(lead, cut))) / _QMAX
    safe = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel: q = 0, scale 0
    q = jnp.clip(jnp.round(w / _expand(safe, w.ndim, lead)), -_QMAX, _QMAX).astype(jnp.int8)
    out[(*path, QUANT)] = var.replace(q)
    out[(*path, SCALE)] = nnx.Param(scale, logical_axes=(*axes[:lead], *axes[cut:]))
  return nnx.from_flat_state(out)


def _expand(scale, ndim: int, lead: int):
  """scale (lead axes, output axes) with W's input axes inserted as 1s after the lead."""
  return scale.reshape(*scale.shape[:lead], *(1,) * (ndim - scale.ndim), *scale.shape[lead:])


def dequantize(base: nnx.State) -> nnx.State:
  """The base as the model takes it: each (int8, scale) pair replaced by the float32
  weight q * scale at its path; a base without pairs is returned as it is."""
  flat = dict(nnx.to_flat_state(base))
  pairs = [p[:-1] for p in flat if p[-1] == QUANT and (*p[:-1], SCALE) in flat]
  if not pairs:
    return base
  for path in pairs:
    q, s = flat.pop((*path, QUANT)), flat.pop((*path, SCALE)).get_value()
    w = q.get_value().astype(jnp.float32) * _expand(s, q.get_value().ndim, _lead(q))
    flat[path] = q.replace(w)
  return nnx.from_flat_state(flat)


def abstract(full_abstract: nnx.State, inputs: dict[tuple, int]) -> nnx.State:
  """The quantised state's abstract shapes and logical axes (no arrays built)."""
  return jax.eval_shape(lambda p: quantize(p, inputs), full_abstract)
