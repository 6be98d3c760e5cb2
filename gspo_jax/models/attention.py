"""Grouped-query attention with optional per-head q/k RMSNorm (Qwen3) and RoPE.

Shapes: the package legend (docs/shapes.md): B prompts (rows when G = 1), G
responses sharing one prompt, S query positions, J key positions, N query heads, C kv heads,
Q = N / C query heads per kv head; Z query chunks of n queries each.

Keys come in up to two segments so that G responses can share one prompt's KV cache
without copying it: a *shared* segment with one entry per prompt (B, J, C, H) and an
*own* segment with one entry per response (B, G, J, C, H). Scores of both segments are
softmaxed together (in float32), which is exactly attention over their concatenation.
The KV cache keeps its keys heads-first instead, (B, C, J, H) and (B, G, C, H, J)
(`heads_first=True`): reads over the cache then take it in place, where the time-first
layout made XLA copy the whole growing cache twice per layer and decode step.

Teacher forcing (S > 1) can process queries `query_chunk` = n at a time (`attend_chunked`):
the scores then live as (B, G, C, Q, n, J) per chunk instead of (B, G, C, Q, S, J), in the
forward and, recomputed per chunk, in the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models import matmul
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import RMSNorm, param, rope

Array = jax.Array
Segment = tuple[Array, Array, Array]  # (k, v, mask broadcastable to (B, G, S, J))


class Attention(nnx.Module):
  """Projections and normalisation; the attention itself is `attend` (cache-agnostic)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, N, C, H = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = jnp.dtype(cfg.param_dtype)
    self.dtype = jnp.dtype(cfg.dtype)
    self.matmul = cfg.matmul
    self.theta = cfg.rope_theta
    self.q = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), pd)
    self.k = param(rngs, (D, C, H), ("embed", "kv_heads", "head_dim"), pd)
    self.v = param(rngs, (D, C, H), ("embed", "kv_heads", "head_dim"), pd)
    self.o = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), pd, fan_in=N * H)
    norm = lambda: RMSNorm(H, eps=cfg.rms_eps, axis_name="head_dim", param_dtype=pd, rngs=rngs)
    self.q_norm = norm() if cfg.qk_norm else None
    self.k_norm = norm() if cfg.qk_norm else None

  def qkv(self, x_BxSxD: Array, positions_BxS: Array) -> tuple[Array, Array, Array]:
    """q (B, S, N, H), k and v (B, S, C, H); q/k normalised per head, then rotated."""
    x = x_BxSxD.astype(self.dtype)
    w = lambda p: p[...].astype(self.dtype)
    q = matmul.einsum("bsd,dnh->bsnh", x, w(self.q), self.matmul)
    k = matmul.einsum("bsd,dch->bsch", x, w(self.k), self.matmul)
    v = matmul.einsum("bsd,dch->bsch", x, w(self.v), self.matmul)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    return rope(q, positions_BxS, self.theta), rope(k, positions_BxS, self.theta), v

  def out(self, o_BxSxNxH: Array) -> Array:
    return matmul.einsum("bsnh,nhd->bsd", o_BxSxNxH.astype(self.dtype),
                         self.o[...].astype(self.dtype), self.matmul)


def rounded(x: Array, matmul_dtype) -> Array:
  """x in float32, rounded to `matmul_dtype`'s precision when given (None: unrounded).
  A product of two bfloat16 values is exact in float32, so multiply-and-reduce over such
  inputs is the narrow matmul with float32 accumulation, up to summation order.
  `reduce_precision`, not a cast there and back: XLA drops a float32 -> bfloat16 ->
  float32 round trip as excess precision (`xla_allow_excess_precision`, on by default),
  and the sampler's log-probs then moved up to 2e-2 away from teacher forcing's."""
  x = x.astype(jnp.float32)
  if matmul_dtype is None:
    return x
  info = jnp.finfo(matmul_dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _scores(q_BxGxSxCxQxH: Array, k: Array, spec: str, reduce: bool, matmul_dtype) -> Array:
  """float32 q.k over head_dim -> (B, G, C, Q, S, J), for keys laid out as `spec`.

  reduce: one query per response (S = 1) against own keys stored (B, G, C, H, J).
  matmul_dtype: q and k rounded to it, products accumulated in float32 (`models.matmul`)."""
  if not reduce:
    if matmul_dtype is not None:
      return matmul.einsum(f"bgscrh,{spec}->bgcrsk", q_BxGxSxCxQxH, k, matmul_dtype,
                           canonical=True)
    return jnp.einsum(f"bgscrh,{spec}->bgcrsk", q_BxGxSxCxQxH, k,
                      preferred_element_type=jnp.float32)
  # The cache's keys are rounded as they are written (`Transformer.decode`): rounding the
  # whole cache here, every step, made XLA rewrite it instead of updating it in place.
  q = rounded(q_BxGxSxCxQxH[:, :, 0, :, :, :, None], matmul_dtype)   # (B, G, C, Q, H, 1)
  return jnp.sum(q * k[:, :, :, None].astype(jnp.float32), -2)[:, :, :, :, None]


def _values(p_BxGxCxQxSxJ: Array, v: Array, spec: str, reduce: bool, matmul_dtype) -> Array:
  """Sum of p-weighted values over the keys -> (B, G, S, C, Q, H) (`reduce` and
  `matmul_dtype` as in _scores, values stored (B, G, C, J, H))."""
  if not reduce:
    if matmul_dtype is not None:
      o = matmul.einsum(f"bgcrsk,{spec}->bgscrh", p_BxGxCxQxSxJ, v, matmul_dtype,
                        canonical=True)
      return o.astype(p_BxGxCxQxSxJ.dtype)
    return jnp.einsum(f"bgcrsk,{spec}->bgscrh", p_BxGxCxQxSxJ, v)
  p = rounded(p_BxGxCxQxSxJ[:, :, :, :, 0, :, None], matmul_dtype)       # (B, G, C, Q, J, 1)
  o = jnp.sum(p * v[:, :, :, None].astype(jnp.float32), -2)[:, :, None]  # float32 accumulation
  return o.astype(p_BxGxCxQxSxJ.dtype)


def attend(q_BxGxSxNxH: Array, *, shared: Segment | None = None,
           own: Segment | None = None, new: Segment | None = None,
           heads_first: bool = False, query_chunk: int = 0, matmul_dtype=None) -> Array:
  """softmax(q k^T / sqrt(H) + mask) v over the shared, own and new key segments.

  Args:
    q_BxGxSxNxH: queries, heads in HF order (query head n uses kv head n // Q).
    shared: (k_BxJxCxH, v_BxJxCxH, mask) keys common to the G responses of a row.
    own: (k_BxGxJxCxH, v_BxGxJxCxH, mask) keys of each response.
    new: (k_BxGxJxCxH, v_BxGxJxCxH, mask) more keys of each response, time-first whatever
      `heads_first` says (a decode step's own token, next to a cache it is not yet in).
    Masks are bool, broadcastable to (B, G, S, J); True = may attend.
    heads_first: the KV cache's layouts instead: shared keys and values (B, C, J, H), own
      keys (B, G, C, H, J) and own values (B, G, C, J, H). With one query per response
      (decoding, S = 1) the own segment is read by multiply-and-reduce instead of a batched
      matmul: per step that is a matrix-vector product, memory-bound on every backend, and
      XLA:CPU ran it as a (J x H) @ (H x Q) matmul at a fraction of the speed. Keys with J
      minor reduce over H across contiguous key slots (`benchmark.py decode` measures it).
    query_chunk: n > 0 runs the queries n positions at a time (`attend_chunked`) when
      S > n; 0 = all at once.
    matmul_dtype: the model's `ModelConfig.matmul` (None: the operands' dtype). When set,
      both products (q k^T, and the probabilities times v) take inputs rounded to it and
      accumulate in float32 (`models.matmul.einsum`; a decode step's multiply-and-reduce
      over inputs rounded to it, `rounded`), so a decode step and teacher forcing compute
      the same function. Scores, masking and the softmax stay float32. With
      `heads_first` and S = 1 the own keys and values must hold values already rounded
      to it (a KV cache written through `rounded`, as `Transformer.decode` writes it).
  Returns:
    o_BxGxSxNxH in the query dtype.
  """
  if 0 < query_chunk < q_BxGxSxNxH.shape[2]:
    return attend_chunked(q_BxGxSxNxH, query_chunk, shared=shared, own=own, new=new,
                          heads_first=heads_first, matmul_dtype=matmul_dtype)
  B, G, S, N, H = q_BxGxSxNxH.shape
  C = (shared or own)[0].shape[-3 if heads_first else -2]
  q = q_BxGxSxNxH.reshape(B, G, S, C, N // C, H) * (H ** -0.5)
  neg = jnp.finfo(jnp.float32).min  # finite: a fully masked (padding) query gives no NaN
  specs = {"shared": ("bckh", "bckh") if heads_first else ("bkch", "bkch"),
           "own": ("bgchk", "bgckh") if heads_first else ("bgkch", "bgkch"),
           "new": ("bgkch", "bgkch")}
  scores, values = [], []
  for name, seg in (("shared", shared), ("own", own), ("new", new)):
    if seg is None:
      continue
    (k, v, mask), (k_spec, v_spec) = seg, specs[name]
    reduce = heads_first and S == 1 and name == "own"
    s = _scores(q, k, k_spec, reduce, matmul_dtype)
    m = jnp.broadcast_to(mask, (B, G, S, s.shape[-1]))[:, :, None, None]
    scores.append(jnp.where(m, s, neg))
    values.append((v, v_spec, reduce))
  p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(q.dtype)
  out, start = 0, 0
  for s, (v, spec, reduce) in zip(scores, values):
    J = s.shape[-1]
    out = out + _values(p[..., start:start + J], v, spec, reduce, matmul_dtype)
    start += J
  return out.reshape(B, G, S, N, H)


def attend_chunked(q_BxGxSxNxH: Array, n: int, *, shared: Segment | None = None,
                   own: Segment | None = None, new: Segment | None = None,
                   heads_first: bool = False, matmul_dtype=None) -> Array:
  """`attend` over the queries n positions at a time: the same function, less memory.

  Row s of the output is o_s = sum_k softmax_k(q_s . k_k / sqrt(H) + mask_sk) v_k, which
  reads query s and mask row s only: each query's softmax is independent of the others, so
  splitting S into chunks changes no result beyond float32 summation order inside XLA's
  matmuls (same formula, same float32 softmax per row). S is padded up to a multiple of n
  with zero queries (and all-False rows of masks that have an S axis; a fully masked row
  is finite, see `attend`); their outputs are dropped, so they add nothing to the value or
  the gradient.

  The chunks run one after another (`jax.lax.map`), each under `jax.checkpoint`: the
  backward recomputes a chunk's scores and probabilities from its queries instead of
  storing them for every chunk, so at any time one chunk's (B, G, C, Q, n, J) float32
  scores are live rather than (B, G, C, Q, S, J). Every chunk reads all keys and values,
  and masks whose S-dimension is 1 whole; masks with an S axis are sliced per chunk.
  """
  B, G, S, N, H = q_BxGxSxNxH.shape
  Z = -(-S // n)                       # chunks
  pad = Z * n - S

  def split(x: Array, axis: int) -> Array:
    """x with its S axis (`axis`) padded to Z * n and split into (Z, ..., n, ...)."""
    x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])
    x = x.reshape(x.shape[:axis] + (Z, n) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)

  segments = {"shared": shared, "own": own, "new": new}
  masks, sliced = {}, {}
  for name, seg in segments.items():
    if seg is None:
      continue
    mask = jnp.asarray(seg[2], bool)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # (B|1, G|1, S|1, J|1)
    sliced[name] = mask.shape[2] != 1
    masks[name] = split(mask, 2) if sliced[name] else mask  # padded rows: all False

  def chunk(q_BxGxnxNxH, chunk_masks):
    segs = {name: (seg[0], seg[1], chunk_masks[name] if sliced[name] else masks[name])
            for name, seg in segments.items() if seg is not None}
    return attend(q_BxGxnxNxH, heads_first=heads_first, matmul_dtype=matmul_dtype, **segs)

  # prevent_cse=False: inside a scan the recomputation cannot be merged away (jax docs).
  o_ZxBxGxnxNxH = jax.lax.map(
      lambda xs: jax.checkpoint(chunk, prevent_cse=False)(*xs),
      (split(q_BxGxSxNxH, 2), {name: m for name, m in masks.items() if sliced[name]}))
  o = jnp.moveaxis(o_ZxBxGxnxNxH, 0, 2).reshape(B, G, Z * n, N, H)
  return o[:, :, :S]


def attend_causal(q_BxGxSxNxH: Array, n: int, *, own_kv: tuple[Array, Array],
                  shared: Segment | None = None, query_chunk: int = 0,
                  matmul_dtype=None) -> Array:
  """`attend` with a causal own segment, in query blocks of n that skip the masked keys.

  own_kv = (k_BxGxSxCxH, v_BxGxSxCxH) time-first, one key per query position: query s
  attends to own keys 0..s (the mask `attend` would get is tril(S x S)), and to every key of
  `shared` its mask allows. Block z (queries zn .. zn + n - 1) reads own keys 0 .. zn + n - 1
  only: the keys it skips are masked for every query of the block, and a masked key adds
  exactly 0 to the softmax's sum and to the output (exp(min_float32 - max) underflows to 0),
  so this is `attend`'s function up to float32 summation order, at
  (Z + 1) / (2Z) of the own segment's score and value FLOPs, Z = ceil(S / n) blocks. The
  blocks are unrolled (each has its own static key length); `query_chunk` still splits
  each block's queries as in `attend`.
  """
  S = q_BxGxSxNxH.shape[2]
  k, v = own_kv
  outs = []
  for start in range(0, S, n):
    end = min(start + n, S)
    causal = (jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None])[None, None]
    seg = shared
    if shared is not None and jnp.ndim(shared[2]) == 4 and shared[2].shape[2] == S:
      seg = (shared[0], shared[1], shared[2][:, :, start:end])  # a mask with an S axis
    outs.append(attend(q_BxGxSxNxH[:, :, start:end], shared=seg,
                       own=(k[:, :, :end], v[:, :, :end], causal),
                       query_chunk=query_chunk, matmul_dtype=matmul_dtype))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
