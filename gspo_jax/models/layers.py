"""Small building blocks: parameters with logical axis names, RMSNorm, RoPE, SwiGLU MLP.

Logical axis names (mapped to mesh axes by one rules table, see the sharding issue):
  vocab, embed (the residual width), heads, kv_heads, head_dim, mlp, expert.
Each parameter stores its names as Variable metadata `logical_axes`.

Shapes: the package legend (docs/shapes.md); f (this module's own) the H/2 rotary frequencies.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models import matmul

Array = jax.Array


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype,
          init: Callable | None = None, fan_in: int | None = None) -> nnx.Param:
  """A parameter initialised N(0, 1/fan_in) (fan_in defaults to shape[0]), or by `init`."""
  assert len(shape) == len(axes), (shape, axes)
  if init is None:
    std = (fan_in or shape[0]) ** -0.5
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  else:
    value = init(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  """y = weight * (x / sqrt(mean(x^2) + eps)), normalised in float32 then cast back (HF Qwen3)."""

  def __init__(self, dim: int, *, eps: float, axis_name: str, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis_name,))

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    h = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    w = self.weight[...].astype(x.dtype)
    return w.reshape((1,) * (x.ndim - 1) + w.shape) * h.astype(x.dtype)


def rope(x_BxSxNxH: Array, positions_BxS: Array, theta: float) -> Array:
  """Rotary embedding, split-half (NeoX / HF `rotate_half`) layout, computed in float32."""
  H = x_BxSxNxH.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  angles_BxSxf = positions_BxS.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
  cos = jnp.cos(angles_BxSxf)[:, :, None, :]
  sin = jnp.sin(angles_BxSxf)[:, :, None, :]
  x = x_BxSxNxH.astype(jnp.float32)
  x1, x2 = x[..., : H // 2], x[..., H // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxSxNxH.dtype)


class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up))."""

  def __init__(self, hidden: int, mlp_dim: int, *, dtype, param_dtype, rngs: nnx.Rngs,
               matmul_dtype=None):
    self.dtype = dtype
    self.matmul = matmul_dtype  # `models.matmul.einsum`'s input dtype (None: x's)
    self.gate = param(rngs, (hidden, mlp_dim), ("embed", "mlp"), param_dtype)
    self.up = param(rngs, (hidden, mlp_dim), ("embed", "mlp"), param_dtype)
    self.down = param(rngs, (mlp_dim, hidden), ("mlp", "embed"), param_dtype)

  def __call__(self, x_BxSxD: Array) -> Array:
    # As 2-D matmuls over the flattened tokens: with the 3-D einsums, XLA:CPU's backward
    # wrote the (mlp x tokens) activation gradients transposed inside elementwise fusions,
    # and the MLP's forward + backward took about twice as long (same values).
    x = x_BxSxD.astype(self.dtype).reshape(-1, x_BxSxD.shape[-1])
    mm = lambda a, w: matmul.einsum("nd,df->nf", a, w[...].astype(self.dtype), self.matmul)
    g = mm(x, self.gate)
    u = mm(x, self.up)
    y = mm(jax.nn.silu(g) * u, self.down)
    return y.reshape(*x_BxSxD.shape[:-1], y.shape[-1])
