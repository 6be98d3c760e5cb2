"""Teacher forcing: log-probs of given responses under a policy, in one forward.

Shapes: the package legend (docs/shapes.md).

The layout is the sampler's (`gspo_jax.rollout.sampling`): prompts right-padded to P with
`prompt_lens_B` valid tokens; prompt token p at position p, response token t at position
prompt_len + t. Response token t is predicted by the hidden state of the token before it
(the last prompt token for t = 0), so these log-probs equal the sampler's own (tested).
pi_theta in the update, pi_old and pi_ref in `prepare`, and the cold start's SFT loss all
come from `response_logprobs`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gspo_jax.models.logprobs import local_logprobs, token_logprobs_from_hidden
from gspo_jax.models.transformer import Transformer
from gspo_jax.parallel import sharding

Array = jax.Array


def prompt_forward(model: Transformer, prompts_BxP: Array, prompt_lens_B: Array, *,
                   replay: tuple[Array, ...] | None = None):
  """The forward over right-padded prompts that both the sampler's prefill and shared-prefix
  teacher forcing start from: (ModelOutput, valid_BxP, hidden of each last prompt token
  last_BxD)."""
  B, P = prompts_BxP.shape
  positions_BxP = jnp.broadcast_to(jnp.arange(P), (B, P))
  valid_BxP = positions_BxP < prompt_lens_B[:, None]
  out = model(prompts_BxP, positions_BxP, valid_BxP, replay=replay)
  last_BxD = jnp.take_along_axis(out.hidden_BxSxD, (prompt_lens_B - 1)[:, None, None], 1)[:, 0]
  return out, valid_BxP, last_BxD


def response_logprobs(model: Transformer, prompts_BxP: Array, prompt_lens_B: Array,
                      tokens_BxGxT: Array, *, temperature: float = 1.0,
                      replay: tuple[Array, ...] | None = None, share_prompts: bool = True,
                      chunk_size: int = 128, chunks: int = 1):
  """Teacher-forced log-probs of responses (what the trainer computes for pi_theta / pi_old).

  Each of the B*G rows is [prompt (right-padded to P), response (T)] with prompt positions
  0..P-1 (padding invalid) and response positions prompt_len + t; response token t is
  predicted from the hidden state of the token before it (the last prompt token for t=0).
  Uses the memory-lean `token_logprobs_from_hidden`.

  With G > 1 and `share_prompts` each prompt is computed once and its keys are shared by
  its G responses (`Transformer.extend`): P + G*T positions per prompt instead of
  G*(P + T), the same function (tested to float rounding, gradients included). G = 1, or
  `share_prompts=False`, runs the plain forward over the B*G concatenated rows.

  replay: per MoE layer (B*G, P+T, K) expert indices (Routing Replay); with shared prompts
  the prompt part is taken from each group's first row (a prompt routes the same in every
  row).
  chunks: > 1 computes the B prompts in this many groups one after another
  (`chunked_logprobs`: the same log-probs, a chunks-th of the activations alive; no replay,
  and no RouterInfo: None is returned in its place).
  Returns:
    (logp_BxGxT float32, RouterInfo: expert indices per MoE layer (B*G, P+T, K); its aux_loss
    counts each prompt once when G > 1).
  """
  B, P = prompts_BxP.shape
  _, G, T = tokens_BxGxT.shape
  if chunks > 1:
    if replay is not None:
      raise ValueError("response_logprobs: chunks > 1 cannot replay expert choices")
    return chunked_logprobs(model, prompts_BxP, prompt_lens_B, tokens_BxGxT, chunks=chunks,
                            temperature=temperature, share_prompts=share_prompts,
                            chunk_size=chunk_size), None
  if G > 1 and share_prompts:
    return _shared_prefix_logprobs(model, prompts_BxP, prompt_lens_B, tokens_BxGxT,
                                   temperature=temperature, replay=replay, chunk_size=chunk_size)
  rows = lambda x: jnp.repeat(x, G, axis=0)
  lens = rows(prompt_lens_B)
  seq = jnp.concatenate([rows(prompts_BxP), tokens_BxGxT.reshape(B * G, T)], axis=1)
  positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(P), (B * G, P)),
                               lens[:, None] + jnp.arange(T)[None, :]], axis=1)
  valid = jnp.concatenate([jnp.arange(P)[None, :] < lens[:, None], jnp.ones((B * G, T), bool)], 1)
  out = model(seq, positions, valid, replay=replay)
  # Index of the hidden state that predicts response token t.
  src = jnp.concatenate([lens[:, None] - 1, P + jnp.broadcast_to(jnp.arange(T - 1), (B * G, T - 1))],
                        axis=1)
  h = jnp.take_along_axis(out.hidden_BxSxD, src[..., None], axis=1)
  logp = _logprobs(model, h, tokens_BxGxT.reshape(B * G, T), temperature, chunk_size)
  return logp.reshape(B, G, T), out.router


def _logprobs(model: Transformer, h_RxTxD: Array, tokens_RxT: Array, temperature, chunk_size):
  """`token_logprobs_from_hidden`; on a program's mesh (`sharding.on_mesh`), per device
  (`logprobs.local_logprobs` in a shard_map): each device scores its own rows against the
  unembedding gathered over fsdp once (vocab stays split by tensor), so logits are never
  replicated and the weight gradient is reduced once per call, not once per chunk. Rows
  that the batch axes do not divide take the plain path."""
  mesh = jax.sharding.get_abstract_mesh()
  rows = sharding.ACTIVATION_RULES["batch"]
  if mesh.empty or mesh.size == 1 or h_RxTxD.shape[0] % sharding.batch_ways(mesh):
    return token_logprobs_from_hidden(h_RxTxD, model.unembed_DxV(), tokens_RxT,
                                      temperature=temperature, chunk_size=chunk_size,
                                      matmul_dtype=model.cfg.matmul)
  vocab = sharding.PARAM_RULES["vocab"]
  local = functools.partial(local_logprobs, vocab_axis=vocab, temperature=temperature,
                            chunk_size=chunk_size, matmul_dtype=model.cfg.matmul)
  return jax.shard_map(local, in_specs=(P(rows), P(None, vocab), P(rows)),
                       out_specs=P(rows))(h_RxTxD, model.unembed_DxV(gather=True), tokens_RxT)


def chunked_logprobs(model: Transformer, prompts_BxP: Array, prompt_lens_B: Array,
                     tokens_BxGxT: Array, *, chunks: int, **kwargs) -> Array:
  """`response_logprobs`' log-probs (b, g, T), computed for `chunks` groups of B/chunks
  prompts one after another (`lax.map`): the same values with a `chunks`-th of the
  activations alive at once (what bounds `prepare`'s memory). Chunk c holds prompts c,
  c + chunks, c + 2*chunks, ...; on a program's mesh each chunk's rows are split over the
  batch axes, so every device works on every chunk. No router statistics."""
  B = prompts_BxP.shape[0]
  if B % chunks:
    raise ValueError(f"chunked_logprobs: {chunks} chunks do not divide the {B} prompts")

  def split(x):  # (B, ...) -> (chunks, B / chunks, ...), interleaved
    y = jnp.swapaxes(x.reshape(B // chunks, chunks, *x.shape[1:]), 0, 1)
    return sharding.constrain(y, (None, "batch") + (None,) * (x.ndim - 1))

  def one(args):
    return response_logprobs(model, *args, **kwargs)[0]

  out = jax.lax.map(one, (split(prompts_BxP), split(prompt_lens_B), split(tokens_BxGxT)))
  return jnp.swapaxes(out, 0, 1).reshape(B, *out.shape[2:])


def _shared_prefix_logprobs(model: Transformer, prompts_BxP, prompt_lens_B, tokens_BxGxT, *,
                            temperature, replay, chunk_size):
  """`response_logprobs` with each prompt computed once for its G responses."""
  B, P = prompts_BxP.shape
  _, G, T = tokens_BxGxT.shape
  prompt_replay = cont_replay = None
  if replay is not None:
    prompt_replay = tuple(r.reshape(B, G, P + T, -1)[:, 0, :P] for r in replay)
    cont_replay = tuple(r[:, P:] for r in replay)
  prefix, valid_BxP, last_BxD = prompt_forward(model, prompts_BxP, prompt_lens_B,
                                                replay=prompt_replay)
  positions = prompt_lens_B[:, None, None] + jnp.arange(T)[None, None, :]
  cont = model.extend(prefix, valid_BxP, tokens_BxGxT, jnp.broadcast_to(positions, (B, G, T)),
                      replay=cont_replay)
  # Response token 0 is predicted by the last prompt token, token t by response token t-1.
  first = jnp.broadcast_to(last_BxD[:, None, None], (B, G, 1, last_BxD.shape[-1]))
  h = jnp.concatenate([first.reshape(B * G, 1, -1), cont.hidden_BxSxD[:, :T - 1]], axis=1)
  logp = _logprobs(model, h, tokens_BxGxT.reshape(B * G, T), temperature, chunk_size)
  # Expert choices in the layout of the unshared forward: (B*G, P+T, K) per MoE layer.
  indices = tuple(jnp.concatenate([jnp.repeat(p, G, axis=0), c], axis=1)
                  for p, c in zip(prefix.router.indices, cont.router.indices))
  router = prefix.router.replace(indices=indices,
                                 aux_loss=prefix.router.aux_loss + cont.router.aux_loss)
  return logp.reshape(B, G, T), router
