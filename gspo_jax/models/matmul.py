"""Matmuls whose inputs may be rounded to a narrower dtype, accumulated in float32.

`ModelConfig.matmul_dtype = "bfloat16"` with float32 activations: each matmul (attention
projections, MLP, the output projection, and attention's two products, q k^T and the
probabilities times v: `attention.attend`) casts both operands to bfloat16 and
accumulates the products in float32,

    y = einsum(spec, bf16(x), bf16(w))  accumulated in float32,
    dx = einsum(out,rhs->lhs)(bf16(dy), bf16(w)),  dw = einsum(lhs,out->rhs)(bf16(x), bf16(dy)),

both of the backward's matmuls in the same precision (a custom VJP: JAX's own transpose
of a float32-accumulating bfloat16 dot multiplies the float32 cotangent by the bfloat16
operand, which XLA:CPU runs in float32, and rounds the input gradient to bfloat16). Only the
products' inputs are rounded (8 bits of mantissa); every sum, the residual stream, norms,
the attention scores and softmax, and log-probs stay float32. This is the arithmetic a TPU's MXU does for float32
matmuls at default precision, and on CPUs with AMX-BF16 / AVX512-BF16 XLA runs it ~3x
faster than float32 (docs/update_speed.md). On other CPUs it is emulated and slower.

`matmul_dtype` None (the default): the einsum in the operands' own dtype, as before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


def einsum(spec: str, x: Array, w: Array, matmul_dtype=None, canonical: bool = False) -> Array:
  """`jnp.einsum(spec, x, w)` for a two-operand `spec` ("lhs,rhs->out", explicit letters).

  matmul_dtype None: unchanged. Otherwise operands in `matmul_dtype`, products accumulated
  and returned in float32, and the same in both matmuls of the backward pass (the gradients
  come back in x's and w's own dtypes). canonical: each of the three matmuls runs as one
  row-major (batch, free, summed) x (batch, summed, free) product, its operands and result
  materialised in that order (`_dot`): for batched contractions such as attention's, whose
  transposes XLA would otherwise fold into a dot form XLA:CPU runs only in float32."""
  if matmul_dtype is None:
    return jnp.einsum(spec, x, w)
  # Inside shard_map, an operand may vary over fewer mesh axes than the other (hidden states
  # replicated over `tensor` against a vocabulary split by it). The custom VJP must return
  # each gradient with its operand's type, so both are made to vary alike first: the cast's
  # own transpose then sums the gradient over the axes the operand did not vary over.
  both = varying_axes(x) | varying_axes(w)
  x, w = (jax.lax.pcast(a, tuple(sorted(both - varying_axes(a))), to="varying")
          if both - varying_axes(a) else a for a in (x, w))
  return _narrow_einsum(spec, jnp.dtype(matmul_dtype).name, canonical, x, w)


def varying_axes(x: Array) -> frozenset[str]:
  """The mesh axes `x` varies over inside `shard_map` (empty outside it). JAX has no public
  name for this yet: it is `jax.typeof(x).mat.varying` from jax 0.10 to 0.12, read here and
  nowhere else; tests/models/test_matmul.py fails by name if it moves."""
  return frozenset(jax.typeof(x).mat.varying)


def _parse(spec: str) -> tuple[str, str, str]:
  lhs, rest = spec.replace(" ", "").split(",")
  rhs, out = rest.split("->")
  # The transposes below need every letter of an operand in the other operand or the
  # output (no letter summed within one operand alone), and no ellipsis.
  if "." in spec or set(lhs) - set(rhs + out) or set(rhs) - set(lhs + out):
    raise ValueError(f"matmul.einsum: spec {spec!r} is not a plain two-operand contraction")
  return lhs, rhs, out


def _dot(spec: str, a: Array, b: Array, canonical: bool) -> Array:
  """The contraction `spec` of narrow a and b with float32 products. canonical: as one
  dot_general of a (batch, a's free, summed) and b (batch, summed, b's free), each
  materialised in that order where it was not, then the output's order (`_ordered`). Without the barriers XLA folds the transposes into the dot's operand or output
  layouts; XLA:CPU's fast kernels take a bfloat16 x bfloat16 -> float32 dot only in the
  row-major form, and its generic dot has none ("Unsupported element type for
  DotThunk")."""
  if not canonical:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  lhs, rhs, out = _parse(spec)
  batch = [c for c in out if c in lhs and c in rhs]
  a_free, b_free = [c for c in out if c not in rhs], [c for c in out if c not in lhs]
  summed = [c for c in lhs if c not in out]
  a = _ordered(a, [lhs.index(c) for c in batch + a_free + summed])
  b = _ordered(b, [rhs.index(c) for c in batch + summed + b_free])
  nb, nf, ns = len(batch), len(a_free), len(summed)
  y = jax.lax.dot_general(
      a, b, ((tuple(range(nb + nf, nb + nf + ns)), tuple(range(nb, nb + ns))),
             (tuple(range(nb)), tuple(range(nb)))), preferred_element_type=jnp.float32)
  res = batch + a_free + b_free
  return _ordered(y, [res.index(c) for c in out], barrier_first=True)


def _ordered(x: Array, perm: list[int], barrier_first: bool = False) -> Array:
  """x transposed by perm, materialised (an optimization barrier after the transpose, or
  before it for a dot's result). An operand already in order passes untouched: a barrier
  would make XLA copy it (a decode step's whole KV cache, every layer and step)."""
  if perm == sorted(perm):
    return x
  if barrier_first:
    return jnp.transpose(jax.lax.optimization_barrier(x), perm)
  return jax.lax.optimization_barrier(jnp.transpose(x, perm))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _narrow_einsum(spec: str, dtype: str, canonical: bool, x: Array, w: Array) -> Array:
  _parse(spec)
  return _dot(spec, x.astype(dtype), w.astype(dtype), canonical)


def _fwd(spec, dtype, canonical, x, w):
  xn, wn = x.astype(dtype), w.astype(dtype)
  y = _dot(spec, xn, wn, canonical)
  # Residuals in the narrow dtype: half the bytes of float32 ones. The zero-size arrays
  # carry the operands' own dtypes to the backward pass.
  return y, (xn, wn, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _bwd(spec, dtype, canonical, res, dy):
  xn, wn, x_dtype, w_dtype = res
  lhs, rhs, out = _parse(spec)
  dyn = dy.astype(dtype)
  dx = _dot(f"{out},{rhs}->{lhs}", dyn, wn, canonical)
  dw = _dot(f"{lhs},{out}->{rhs}", xn, dyn, canonical)
  # Without the barrier XLA folds a transpose that follows (a tied embedding's gradient,
  # w = table.T) into the dot's output layout, which XLA:CPU's runtime dot does not run
  # for bfloat16 x bfloat16 -> float32 ("Unsupported element type for DotThunk").
  dx, dw = jax.lax.optimization_barrier((dx, dw))
  return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


_narrow_einsum.defvjp(_fwd, _bwd)
