"""Decoder-only transformer (Qwen3 dense / MoE, Llama-style without q/k norm) in Flax NNX.

Legend: B rows, G responses per prompt, S positions, P prompt positions, T response
positions, D hidden, V vocabulary, C kv heads, H head_dim, L layers, K experts per token.

Block (pre-norm, as HF Qwen3): x += attn(norm(x)); x += mlp_or_moe(norm(x)); then a final
norm and the unembedding (the embedding table transposed when tied).

Two entry points share the weights:
  * `__call__(tokens_BxS, positions_BxS, valid_BxS)`: full causal forward (training,
    teacher forcing, prefill). A key is visible to a query iff it is valid and its position
    is <= the query's, so right-padded prompts followed by responses work unchanged.
  * `decode(tokens_BxG, positions_BxG, cache)`: one new token for each of G responses per
    row, attending to the row's shared prompt cache and the response's own cache.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models.attention import Attention, attend
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import MLP, RMSNorm, param
from gspo_jax.models.moe import MoE

Array = jax.Array


@flax.struct.dataclass
class RouterInfo:
  """Expert choices of the MoE layers (in layer order) and their summed balancing loss."""
  indices: tuple[Array, ...]   # per MoE layer: (B, S, K) int32
  aux_loss: Array               # scalar, sum over MoE layers


@flax.struct.dataclass
class ModelOutput:
  hidden_BxSxD: Array           # after the final norm
  kv: tuple[tuple[Array, Array], ...]  # per layer (k_BxSxCxH, v_BxSxCxH), RoPE applied
  router: RouterInfo


@flax.struct.dataclass
class KVCache:
  """Shared prompt keys (one per row) and per-response keys, per layer."""
  prefix_k: tuple[Array, ...]   # per layer (B, P, C, H)
  prefix_v: tuple[Array, ...]
  prefix_valid_BxP: Array        # bool
  k: tuple[Array, ...]           # per layer (B, G, T, C, H)
  v: tuple[Array, ...]
  index: Array                   # int32 scalar: the slot the next token is written to

  @classmethod
  def from_prefill(cls, out: ModelOutput, valid_BxP: Array, group_size: int, max_len: int):
    B, P, C, H = out.kv[0][0].shape
    empty = lambda kv: jnp.zeros((B, group_size, max_len, C, H), kv.dtype)
    return cls(prefix_k=tuple(k for k, _ in out.kv), prefix_v=tuple(v for _, v in out.kv),
               prefix_valid_BxP=valid_BxP.astype(bool),
               k=tuple(empty(k) for k, _ in out.kv), v=tuple(empty(v) for _, v in out.kv),
               index=jnp.zeros((), jnp.int32))


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    norm = lambda: RMSNorm(cfg.hidden, eps=cfg.rms_eps, axis_name="embed", param_dtype=pd, rngs=rngs)
    self.attn_norm = norm()
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = norm()
    self.is_moe = cfg.is_moe_layer(layer)
    if self.is_moe:
      self.mlp = MoE(cfg, rngs=rngs)
    else:
      self.mlp = MLP(cfg.hidden, cfg.mlp_dim, dtype=jnp.dtype(cfg.dtype), param_dtype=pd, rngs=rngs)

  def feed_forward(self, x_BxSxD, valid_BxS, replay_BxSxK):
    """x + mlp(norm(x)); for MoE layers also (indices, aux_loss)."""
    h = self.mlp_norm(x_BxSxD)
    if not self.is_moe:
      return x_BxSxD + self.mlp(h).astype(x_BxSxD.dtype), None, None
    y, indices, aux = self.mlp(h, valid_BxS=valid_BxS, replay_BxSxK=replay_BxSxK)
    return x_BxSxD + y.astype(x_BxSxD.dtype), indices, aux


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = jnp.dtype(cfg.param_dtype)
    self.dtype = jnp.dtype(cfg.dtype)
    normal = lambda key, shape, dtype: 0.02 * jax.random.normal(key, shape, dtype)
    self.embed = param(rngs, (cfg.vocab_size, cfg.hidden), ("vocab", "embed"), pd, init=normal)
    self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden, eps=cfg.rms_eps, axis_name="embed", param_dtype=pd,
                              rngs=rngs)
    self.lm_head = None if cfg.tie_embeddings else param(
        rngs, (cfg.hidden, cfg.vocab_size), ("embed", "vocab"), pd)

  def unembed_DxV(self) -> Array:
    return self.embed[...].T if self.lm_head is None else self.lm_head[...]

  def logits(self, hidden_xD: Array) -> Array:
    """Float32 logits of hidden states of any leading shape."""
    return jnp.einsum("...d,dv->...v", hidden_xD, self.unembed_DxV(),
                      preferred_element_type=jnp.float32)

  def _embed(self, tokens: Array) -> Array:
    return jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)

  def __call__(self, tokens_BxS: Array, positions_BxS: Array, valid_BxS: Array | None = None, *,
               replay: tuple[Array, ...] | None = None,
               embeds_BxSxD: Array | None = None) -> ModelOutput:
    """Full causal forward.

    Args:
      tokens_BxS, positions_BxS: ids and RoPE positions.
      valid_BxS: False at padding (never attended to, excluded from router statistics).
      replay: Routing Replay, per MoE layer (B, S, K) expert indices to use instead of
        the router's top-k.
      embeds_BxSxD: input embeddings to use instead of looking up `tokens_BxS`.
    """
    B, S = tokens_BxS.shape
    valid = jnp.ones((B, S), bool) if valid_BxS is None else valid_BxS.astype(bool)
    self._check_replay(replay)
    mask_BxGxSxS = (valid[:, None, :] & (positions_BxS[:, None, :] <= positions_BxS[:, :, None])
                    )[:, None]
    x = self._embed(tokens_BxS) if embeds_BxSxD is None else embeds_BxSxD.astype(self.dtype)
    kvs, indices, aux = [], [], jnp.zeros((), jnp.float32)
    for layer in self.layers:
      q, k, v = layer.attn.qkv(layer.attn_norm(x), positions_BxS)
      o = attend(q[:, None], own=(k[:, None], v[:, None], mask_BxGxSxS))[:, 0]
      x = x + layer.attn.out(o).astype(x.dtype)
      r = replay[len(indices)] if (replay is not None and layer.is_moe) else None
      x, idx, a = layer.feed_forward(x, valid, r)
      if idx is not None:
        indices.append(idx)
        aux = aux + a
      kvs.append((k, v))
    return ModelOutput(self.final_norm(x), tuple(kvs), RouterInfo(tuple(indices), aux))

  def decode(self, tokens_BxG: Array, positions_BxG: Array, cache: KVCache
             ) -> tuple[Array, KVCache]:
    """One token per response: write its keys at `cache.index`, attend, return hidden_BxGxD."""
    B, G = tokens_BxG.shape
    T = cache.k[0].shape[2]
    pos = positions_BxG.reshape(B * G, 1)
    x = self._embed(tokens_BxG.reshape(B * G, 1))
    prefix_mask = cache.prefix_valid_BxP[:, None, None, :]          # (B, 1, 1, P)
    own_mask = (jnp.arange(T) <= cache.index)[None, None, None, :]  # slots written so far
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      q, k, v = layer.attn.qkv(layer.attn_norm(x), pos)
      put = lambda buf, x1: jax.lax.dynamic_update_slice(
          buf, x1.reshape(B, G, 1, *x1.shape[2:]).astype(buf.dtype), (0, 0, cache.index, 0, 0))
      k_i, v_i = put(cache.k[i], k), put(cache.v[i], v)
      o = attend(q.reshape(B, G, 1, *q.shape[2:]),
                 shared=(cache.prefix_k[i], cache.prefix_v[i], prefix_mask),
                 own=(k_i, v_i, own_mask))
      x = x + layer.attn.out(o.reshape(B * G, 1, *o.shape[3:])).astype(x.dtype)
      x, _, _ = layer.feed_forward(x, None, None)
      new_k.append(k_i)
      new_v.append(v_i)
    cache = cache.replace(k=tuple(new_k), v=tuple(new_v), index=cache.index + 1)
    return self.final_norm(x).reshape(B, G, -1), cache

  def _check_replay(self, replay):
    if replay is not None and len(replay) != self.cfg.num_moe_layers:
      raise ValueError(f"replay must hold one (B, S, K) index array per MoE layer "
                       f"({self.cfg.num_moe_layers}); got {len(replay)}")


def create(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """Build a model with its initialisation compiled as one program (fast on CPU)."""
  return nnx.jit(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))()
