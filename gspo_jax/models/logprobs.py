"""Per-token log-probabilities of given tokens, in float32 (or wider).

Shapes: the package legend (docs/shapes.md), read as in the loss library: B counts rows
(any leading shape; R in the legend), T tokens; Z chunks of n positions each (n this
module's own).

`token_logprobs` takes logits. `token_logprobs_from_hidden` takes the final hidden
states and the unembedding matrix and never materialises the full B x T x V float32
logits: it scans over chunks of the T axis, and `jax.checkpoint` on the chunk makes the
backward pass recompute each chunk's logits instead of storing them. Peak memory for
the logits is then B x chunk_size x V x 4 bytes instead of B x T x V x 4 (twice that in
the backward pass). `experiments/benchmark.py logprobs` measures both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gspo_jax.models import matmul
from gspo_jax.utils import checks

Array = jax.Array


def _check_temperature(fn: str, temperature) -> None:
  checks.check_positive(fn, "temperature", temperature)


def _logprob_of(logits_xV: Array, tokens_x: Array, vocab_axis: str | None = None) -> Array:
  """log softmax(logits)[token] = logit[token] - logsumexp(logits), computed in float.

  With `vocab_axis` (inside `jax.shard_map`) each device holds a contiguous slice of the
  vocabulary, in axis-index order: the max, the sum of exponentials and the picked logit
  are combined over that axis."""
  if vocab_axis is None:
    lse = jax.nn.logsumexp(logits_xV, axis=-1)
    picked = jnp.take_along_axis(logits_xV, tokens_x[..., None], axis=-1)[..., 0]
    return picked - lse
  V = logits_xV.shape[-1]
  # The shift cancels in value and gradient; stopped before pmax, which has no JVP.
  top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits_xV, axis=-1)), vocab_axis)
  lse = jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits_xV - top[..., None]), axis=-1),
                             vocab_axis)) + top
  local = tokens_x - jax.lax.axis_index(vocab_axis) * V
  mine = (local >= 0) & (local < V)
  picked = jnp.take_along_axis(logits_xV, jnp.clip(local, 0, V - 1)[..., None], axis=-1)[..., 0]
  return jax.lax.psum(jnp.where(mine, picked, 0), vocab_axis) - lse


def token_logprobs(logits_BxTxV: Array, tokens_BxT: Array, *, temperature=1.0) -> Array:
  """log softmax(logits / temperature)[tokens], upcast to at least float32.

  Args:
    logits_BxTxV: logits at the positions that predict `tokens_BxT` (already shifted).
    tokens_BxT: integer ids in [0, V).
    temperature: the sampling temperature whose distribution the log-probs describe.
  Returns:
    logp_BxT.
  """
  fn = "token_logprobs"
  checks.check_float(fn, "logits_BxTxV", logits_BxTxV)
  checks.check_shape(fn, "tokens_BxT", tokens_BxT, logits_BxTxV.shape[:-1],
                      "logits_BxTxV.shape[:-1]")
  checks.check_token_ids(fn, "tokens_BxT", tokens_BxT, logits_BxTxV.shape[-1])
  _check_temperature(fn, temperature)
  dtype = jnp.promote_types(logits_BxTxV.dtype, jnp.float32)
  logits = logits_BxTxV.astype(dtype)
  if not (isinstance(temperature, (int, float)) and temperature == 1):
    logits = logits / temperature
  return _logprob_of(logits, tokens_BxT)


def token_logprobs_from_hidden(hidden_BxTxD: Array, unembed_DxV: Array, tokens_BxT: Array, *,
                               temperature=1.0, chunk_size: int = 128,
                               matmul_dtype=None) -> Array:
  """Same values and gradients as `token_logprobs(hidden @ unembed, tokens)`, lean in memory.

  The logits of `chunk_size` positions at a time are computed in float32 (matmul with
  float32 accumulation), reduced to log-probs, and dropped; the backward pass recomputes
  them chunk by chunk. For tied embeddings pass `embedding_VxD.T`.

  Args:
    hidden_BxTxD: final hidden states (after the final norm). Any leading shape.
    unembed_DxV: the output projection.
    tokens_BxT: integer ids in [0, V).
    temperature: as in `token_logprobs`.
    chunk_size: positions along T per chunk (T is padded up to a multiple).
    matmul_dtype: None, or the dtype the logits' matmul takes its inputs in (products still
      accumulated in float32, forward and backward: `models.matmul.einsum`).
  Returns:
    logp_BxT in float32 (float64 if the inputs are float64).
  """
  fn = "token_logprobs_from_hidden"
  checks.check_float(fn, "hidden_BxTxD", hidden_BxTxD)
  checks.check_rank(fn, "unembed_DxV", unembed_DxV, 2, "D, V")
  checks.check_float(fn, "unembed_DxV", unembed_DxV)
  if hidden_BxTxD.shape[-1] != unembed_DxV.shape[0]:
    raise ValueError(f"{fn}: hidden_BxTxD's last dimension ({hidden_BxTxD.shape[-1]}) must equal "
                     f"unembed_DxV's first (D = {unembed_DxV.shape[0]}); for tied embeddings pass "
                     "the embedding table transposed")
  checks.check_shape(fn, "tokens_BxT", tokens_BxT, hidden_BxTxD.shape[:-1],
                      "hidden_BxTxD.shape[:-1]")
  checks.check_token_ids(fn, "tokens_BxT", tokens_BxT, unembed_DxV.shape[1])
  _check_temperature(fn, temperature)
  if not (isinstance(chunk_size, int) and chunk_size > 0):
    raise ValueError(f"{fn}: chunk_size must be a positive int; got {chunk_size!r}")
  if tokens_BxT.ndim == 0 or tokens_BxT.shape[-1] == 0 or tokens_BxT.size == 0:
    dtype = jnp.promote_types(jnp.result_type(hidden_BxTxD, unembed_DxV), jnp.float32)
    return jnp.zeros(tokens_BxT.shape, dtype)
  lead, T = tokens_BxT.shape[:-1], tokens_BxT.shape[-1]
  h_BxTxD = hidden_BxTxD.reshape(-1, T, hidden_BxTxD.shape[-1])
  tok_BxT = tokens_BxT.reshape(-1, T)
  logp_BxT = _chunked_logprobs(h_BxTxD, unembed_DxV, tok_BxT, temperature, min(chunk_size, T),
                               matmul_dtype=matmul_dtype)
  return logp_BxT.reshape(*lead, T)


def local_logprobs(hidden_BxTxD: Array, unembed_DxV: Array, tokens_BxT: Array, *,
                   vocab_axis: str, temperature=1.0, chunk_size: int = 128,
                   matmul_dtype=None) -> Array:
  """`token_logprobs_from_hidden` on one device's block inside `jax.shard_map`: its rows,
  and its slice of the vocabulary along mesh axis `vocab_axis` (the token ids stay
  global). The weight gradient is summed over the chunks on the device and reduced across
  devices once, where the shard_map ends; a chunk loop over globally sharded arrays
  reduces it at every chunk."""
  T = tokens_BxT.shape[-1]
  return _chunked_logprobs(hidden_BxTxD, unembed_DxV, tokens_BxT, temperature,
                           min(chunk_size, T), vocab_axis, matmul_dtype)


def _chunked_logprobs(h_BxTxD, w_DxV, tok_BxT, temperature, chunk, vocab_axis=None,
                      matmul_dtype=None):
  B, T, D = h_BxTxD.shape
  num_chunks = -(-T // chunk)
  pad = num_chunks * chunk - T
  # Padded positions hold zeros and token 0: finite, sliced off below.
  h = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
  tok = jnp.pad(tok_BxT, ((0, 0), (0, pad)))
  # Chunk axis first for the scan; the batch axis stays intact (and keeps its sharding).
  h_ZxBxnxD = h.reshape(B, num_chunks, chunk, D).transpose(1, 0, 2, 3)
  tok_ZxBxn = tok.reshape(B, num_chunks, chunk).transpose(1, 0, 2)
  acc = jnp.promote_types(jnp.result_type(h_BxTxD, w_DxV), jnp.float32)

  @jax.checkpoint  # backward recomputes this chunk's logits rather than saving them
  def chunk_logprobs(h_BxnxD, tok_Bxn):
    if matmul_dtype is None:
      logits = jnp.einsum("bkd,dv->bkv", h_BxnxD, w_DxV, preferred_element_type=acc)
    else:
      logits = matmul.einsum("bkd,dv->bkv", h_BxnxD, w_DxV, matmul_dtype)
    if not (isinstance(temperature, (int, float)) and temperature == 1):
      logits = logits / temperature
    return _logprob_of(logits, tok_Bxn, vocab_axis)

  logp_ZxBxn = jax.lax.map(lambda args: chunk_logprobs(*args), (h_ZxBxnxD, tok_ZxBxn))
  return logp_ZxBxn.transpose(1, 0, 2).reshape(B, num_chunks * chunk)[:, :T]
