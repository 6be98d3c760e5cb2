"""Decoder-only transformer (Qwen3 dense / MoE, Llama-style without q/k norm) in Flax NNX.

Shapes: the package legend (docs/shapes.md); B the model's leading axis:
prompts where a G axis follows, else rows.

Block (pre-norm, as HF Qwen3): x += attn(norm(x)); x += mlp_or_moe(norm(x)); then a final
norm and the unembedding (the embedding table transposed when tied).

With `cfg.scan_layers` the L blocks are one Block whose parameters carry a leading
`layers` axis, and both entry points run a `jax.lax.scan` over it: the compiled program
holds one layer, so compile time no longer grows with depth. Same seed, same weights.
`cfg.remat` wraps each layer in `jax.checkpoint` (see `REMAT_POLICIES`);
`cfg.attention_chunk` runs the attention of both (S > 1) entry points over query chunks
(`attention.attend_chunked`; decode has one query and never chunks).

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

from gspo_jax.models import matmul
from gspo_jax.models.attention import Attention, attend, attend_causal, rounded
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import MLP, RMSNorm, param
from gspo_jax.models.moe import MoE
from gspo_jax.parallel import sharding

Array = jax.Array


@flax.struct.dataclass
class RouterInfo:
  """Expert choices of the MoE layers (in layer order) and their summed balancing loss."""
  indices: tuple[Array, ...]   # per MoE layer: (B, S, K) int32
  aux_loss: Array               # scalar, sum over MoE layers


# Per layer: a tuple of L arrays (unrolled model) or one array with a leading L axis
# (cfg.scan_layers). `x[i]` is layer i either way.
Layers = tuple[Array, ...] | Array


@flax.struct.dataclass
class ModelOutput:
  hidden_BxSxD: Array           # after the final norm
  k: Layers                     # per layer k_BxSxCxH, RoPE applied
  v: Layers                     # per layer v_BxSxCxH
  router: RouterInfo


@flax.struct.dataclass
class KVCache:
  """Shared prompt keys (one per row) and per-response keys, per layer (`Layers`).

  Heads-first layouts (see `attend`): decode steps read the caches in place. A sampler
  starts with few response slots and `grow`s the cache as they fill.
  """
  prefix_k: Layers              # per layer (B, C, P, H)
  prefix_v: Layers
  prefix_valid_BxP: Array        # bool
  k: Layers                     # per layer (B, G, C, H, T): key slots minor (see `attend`)
  v: Layers                     # per layer (B, G, C, T, H)
  index: Array                   # int32 scalar: the slot the next token is written to

  @classmethod
  def from_prefill(cls, out: ModelOutput, valid_BxP: Array, group_size: int, max_len: int,
                   dtype=None):
    """The prompts' keys and `max_len` empty response slots, stored in `dtype` (None: the
    model's); attention reads them in float32 whatever their storage dtype."""
    B, P, C, H = out.k[0].shape
    dtype = out.k[0].dtype if dtype is None else dtype
    if isinstance(out.k, tuple):
      heads_first = lambda xs: tuple(jnp.swapaxes(x, 1, 2).astype(dtype) for x in xs)
      empty = lambda xs, shape: tuple(jnp.zeros((B, group_size) + shape, dtype) for x in xs)
    else:  # stacked layers: (L, B, P, C, H)
      heads_first = lambda x: jnp.swapaxes(x, 2, 3).astype(dtype)
      empty = lambda x, shape: jnp.zeros((x.shape[0], B, group_size) + shape, dtype)
    return cls(prefix_k=heads_first(out.k), prefix_v=heads_first(out.v),
               prefix_valid_BxP=valid_BxP.astype(bool), k=empty(out.k, (C, H, max_len)),
               v=empty(out.v, (C, max_len, H)),
               index=jnp.zeros((), jnp.int32))

  def grow(self, max_len: int) -> "KVCache":
    """The same cache with room for `max_len` response slots (new slots zero)."""
    T = self.v[0].shape[-2]
    if max_len == T:
      return self
    pad = lambda x, axis: jnp.pad(x, [(0, max_len - T) if a == x.ndim + axis else (0, 0)
                                      for a in range(x.ndim)])
    return self.replace(k=jax.tree.map(lambda x: pad(x, -1), self.k),
                        v=jax.tree.map(lambda x: pad(x, -2), self.v))


# Logical axes of the residual stream x_BxSxD in training and teacher forcing.
ROWS = ("batch", "seq", None)

# cfg.remat -> the jax.checkpoint policy of each layer in the backward pass.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,      # keep only each layer's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls
}


def stack_blocks(blocks) -> "Block":
  """One Block holding the parameters of `blocks` stacked on a new leading `layers` axis."""
  graphdef, _ = nnx.split(blocks[0])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
  for var in jax.tree.leaves(stacked, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    var.set_metadata("logical_axes", ("layers",) + tuple(var.get_metadata()["logical_axes"]))
  return nnx.merge(graphdef, stacked)


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
      self.mlp = MLP(cfg.hidden, cfg.mlp_dim, dtype=jnp.dtype(cfg.dtype), param_dtype=pd, rngs=rngs,
                     matmul_dtype=cfg.matmul)

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
    blocks = [Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
    self.layers = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.hidden, eps=cfg.rms_eps, axis_name="embed", param_dtype=pd,
                              rngs=rngs)
    self.lm_head = None if cfg.tie_embeddings else param(
        rngs, (cfg.hidden, cfg.vocab_size), ("embed", "vocab"), pd)

  def unembed_DxV(self, gather: bool = False) -> Array:
    """The output projection in the compute dtype (as every weight; the logits accumulate
    in float32); with `gather`, as one chip uses it under FSDP on a program's mesh
    (`sharding.gathered`: gathered once per call, gradients reduce-scattered)."""
    w = self.embed if self.lm_head is None else self.lm_head
    w = sharding.gathered(w, self.dtype) if gather else w
    w = w[...].astype(self.dtype)
    return w.T if self.lm_head is None else w

  def logits(self, hidden_xD: Array) -> Array:
    """Float32 logits of hidden states of any leading shape (`cfg.matmul_dtype`'s inputs,
    as the teacher-forced log-probs take them)."""
    if self.cfg.matmul is None:
      return jnp.einsum("...d,dv->...v", hidden_xD, self.unembed_DxV(),
                        preferred_element_type=jnp.float32)
    h_nxD = hidden_xD.reshape(-1, hidden_xD.shape[-1])
    logits_nxV = matmul.einsum("nd,dv->nv", h_nxD, self.unembed_DxV(), self.cfg.matmul)
    return logits_nxV.reshape(*hidden_xD.shape[:-1], logits_nxV.shape[-1])

  def _embed(self, tokens: Array) -> Array:
    return jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)

  def _embed_rows(self, tokens: Array) -> Array:
    """`_embed` on a program's mesh without gathering the table: every chip looks up all
    rows' tokens in its slice of the embedding width, and the result is then split by rows
    (an all-to-all of activations instead of an all-gather of the whole table)."""
    tokens = sharding.constrain(tokens, (None,) * tokens.ndim)
    return sharding.constrain(self._embed(tokens), ROWS)

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
    x = self._embed_rows(tokens_BxS) if embeds_BxSxD is None else embeds_BxSxD.astype(self.dtype)

    def layer_fn(graphdef, params, x, replay_BxSxK):
      """One block as a pure function of its parameters (what scan and remat need)."""
      layer = nnx.merge(graphdef, params)
      q, k, v = layer.attn.qkv(layer.attn_norm(x), positions_BxS)
      o = attend(q[:, None], own=(k[:, None], v[:, None], mask_BxGxSxS),
                 query_chunk=self.cfg.attention_chunk, matmul_dtype=self.cfg.matmul)[:, 0]
      x = x + layer.attn.out(o).astype(x.dtype)
      x, idx, aux = layer.feed_forward(x, valid, replay_BxSxK)
      return x, (k, v, idx, aux)

    return self._run_layers(layer_fn, x, (), replay)

  def extend(self, prefix: ModelOutput, prefix_valid_BxP: Array, tokens_BxGxT: Array,
             positions_BxGxT: Array, *, replay: tuple[Array, ...] | None = None) -> ModelOutput:
    """Forward of G continuations of each row after a shared, already computed prefix.

    Continuation token t attends to the row's valid prefix keys (`prefix.k`, `prefix.v`
    from `__call__` on the B prefixes) and causally to its own continuation. Equals the
    full forward over the B*G rows [prefix, continuation] at P + G*T token positions per
    row instead of G*(P + T): the trainer's prefix sharing (`sampling.response_logprobs`).
    Gradients flow into the prefix's keys and values (and so through `__call__`).

    Args:
      prefix: `__call__`'s output for the B prefixes. prefix_valid_BxP: its valid mask.
      tokens_BxGxT, positions_BxGxT: the continuations (every position valid).
      replay: per MoE layer (B*G, T, K) forced expert indices of the continuation tokens.
    Returns:
      ModelOutput over the B*G continuation rows: hidden (B*G, T, D), k/v per layer
      (B*G, T, C, H), router indices per MoE layer (B*G, T, K).
    """
    B, G, T = tokens_BxGxT.shape
    self._check_replay(replay)
    pos = positions_BxGxT.reshape(B * G, T)
    valid = jnp.ones((B * G, T), bool)
    prefix_mask = prefix_valid_BxP.astype(bool)[:, None, None, :]    # (B, 1, 1, P)
    own_mask = jnp.tril(jnp.ones((T, T), bool))[None, None]          # causal, (1, 1, T, T)
    x = self._embed_rows(tokens_BxGxT.reshape(B * G, T))

    def layer_fn(graphdef, params, x, prefix_k, prefix_v, replay_BxSxK):
      layer = nnx.merge(graphdef, params)
      q, k, v = layer.attn.qkv(layer.attn_norm(x), pos)
      group = lambda a: a.reshape(B, G, T, *a.shape[2:])
      if self.cfg.attention_block:  # the same function, without the masked key blocks
        o = attend_causal(group(q), self.cfg.attention_block, own_kv=(group(k), group(v)),
                          shared=(prefix_k, prefix_v, prefix_mask),
                          query_chunk=self.cfg.attention_chunk, matmul_dtype=self.cfg.matmul)
      else:
        o = attend(group(q), shared=(prefix_k, prefix_v, prefix_mask),
                   own=(group(k), group(v), own_mask), query_chunk=self.cfg.attention_chunk,
                   matmul_dtype=self.cfg.matmul)
      x = x + layer.attn.out(o.reshape(B * G, T, *o.shape[3:])).astype(x.dtype)
      x, idx, aux = layer.feed_forward(x, valid, replay_BxSxK)
      return x, (k, v, idx, aux)

    return self._run_layers(layer_fn, x, (prefix.k, prefix.v), replay)

  def _run_layers(self, layer_fn, x, per_layer, replay) -> ModelOutput:
    """x through every block: `layer_fn(graphdef, params, x, *per_layer[i], replay_i)`
    (per_layer: tuples of `Layers`), scanned or unrolled, with `cfg.remat`.

    The residual stream is kept split by rows (`ROWS`) on a program's mesh: each chip
    then gathers a layer's weights once (FSDP) instead of all-reducing the whole batch's
    activations inside every matmul. Decode does not come here: one token per row is too
    little work to pay for gathering every weight at every step."""
    x = sharding.constrain(x, ROWS)
    inner = layer_fn

    def layer_fn(graphdef, params, x, *rest):
      x, outs = inner(graphdef, sharding.gathered(params, self.dtype), x, *rest)
      return sharding.constrain(x, ROWS), outs

    if self.cfg.remat != "none":
      layer_fn = jax.checkpoint(layer_fn, policy=REMAT_POLICIES[self.cfg.remat],
                                static_argnums=(0,))
    if self.cfg.scan_layers:
      graphdef, params = nnx.split(self.layers)
      stacked_replay = None if replay is None else jnp.stack(replay)
      x, (k, v, idx, aux) = jax.lax.scan(
          lambda x, xs: layer_fn(graphdef, xs[0], x, *xs[1], xs[2]),
          x, (params, per_layer, stacked_replay))
      indices = () if idx is None else tuple(idx)
      aux = jnp.zeros((), jnp.float32) if aux is None else jnp.sum(aux)
      return ModelOutput(self.final_norm(x), k, v, RouterInfo(indices, aux))
    ks, vs, indices, aux = [], [], [], jnp.zeros((), jnp.float32)
    for i, layer in enumerate(self.layers):
      r = replay[len(indices)] if (replay is not None and layer.is_moe) else None
      x, (k, v, idx, a) = layer_fn(*nnx.split(layer), x, *(xs[i] for xs in per_layer), r)
      if idx is not None:
        indices.append(idx)
        aux = aux + a
      ks.append(k)
      vs.append(v)
    return ModelOutput(self.final_norm(x), tuple(ks), tuple(vs), RouterInfo(tuple(indices), aux))

  def decode(self, tokens_BxG: Array, positions_BxG: Array, cache: KVCache, *,
             with_experts: bool = False):
    """One token per response: write its keys at `cache.index`, attend; returns
    (hidden_BxGxD, cache), and with `with_experts` also the expert choices of the tokens
    fed, per MoE layer (B*G, 1, K) int32 (what Rollout Routing Replay records).

    Each step reads the whole response cache it is given (T slots, masked to the written
    ones): a sampler sizes the cache to the filled prefix (`KVCache.grow`). The cache is
    updated in place; the two layer layouts need different orders for XLA to see that.

    `cache.index` is a scalar (every response at the same slot: the group sampler) or an
    int32 (B, G) array, one slot per response (the multi-turn sampler, whose responses
    pause for observations at different lengths): each row then writes and attends up to
    its own slot. Either way the index advances by one for every row; a caller that holds
    rows back resets theirs.
    """
    B, G = tokens_BxG.shape
    T = cache.v[0].shape[-2]
    pos = positions_BxG.reshape(B * G, 1)
    x = self._embed(tokens_BxG.reshape(B * G, 1))
    prefix_mask = cache.prefix_valid_BxP[:, None, None, :]          # (B, 1, 1, P)
    slots = jnp.arange(T)[None, None, None, :]
    # One token's (..., 1, C, H) keys and values in the cache's layouts, and their slot.
    key_slot, value_slot = lambda a: jnp.moveaxis(a, -3, -1), lambda a: jnp.swapaxes(a, -3, -2)
    at = lambda x, slot_axis: tuple(cache.index if a == x.ndim + slot_axis else 0
                                    for a in range(x.ndim))
    # Under `matmul_dtype` the cache holds keys and values rounded to it (`attend` reads
    # them so); each token's are rounded once, as they are written.
    narrow = lambda x: rounded(x, self.cfg.matmul).astype(x.dtype)
    put = lambda buf, x, slot_axis: jax.lax.dynamic_update_slice(
        buf, narrow(x).astype(buf.dtype), at(buf, slot_axis))
    index = cache.index
    if index.ndim:  # one slot per response: (B, G, 1, 1) against the (B, G, S, K) masks
      index = index[:, :, None, None]
      put = lambda buf, x, slot_axis: _put_rows(buf, narrow(x), cache.index, slot_axis)

    def layer_fn(graphdef, params, x, k_buf, v_buf, prefix_k, prefix_v, write_first):
      layer = nnx.merge(graphdef, params)
      q, k, v = layer.attn.qkv(layer.attn_norm(x), pos)
      group = lambda a: a.reshape(B, G, *a.shape[1:])               # (B, G, 1, C, H)
      if write_first:  # slot `index` of the caches, then attend to it
        k_buf, v_buf = put(k_buf, key_slot(group(k)), -1), put(v_buf, value_slot(group(v)), -2)
        own, new = (k_buf, v_buf, slots <= index), None
      else:  # attend to the slots before `index` and to this token's keys; the caller writes
        stored = lambda a: narrow(group(a)).astype(k_buf.dtype)  # as the cache will hold it
        own, new = (k_buf, v_buf, slots < index), (stored(k), stored(v), True)
      o = attend(q.reshape(B, G, 1, *q.shape[2:]), shared=(prefix_k, prefix_v, prefix_mask),
                 own=own, new=new, heads_first=True, matmul_dtype=self.cfg.matmul)
      x = x + layer.attn.out(o.reshape(B * G, 1, *o.shape[3:])).astype(x.dtype)
      x, idx, _ = layer.feed_forward(x, None, None)
      return x, ((k_buf, v_buf) if write_first else (group(k), group(v))), idx

    if self.cfg.scan_layers:
      graphdef, params = nnx.split(self.layers)

      def body(x, xs):
        x, kv, idx = layer_fn(graphdef, xs[0], x, *xs[1:], write_first=False)
        return x, (kv, idx if with_experts else None)

      # Scanned layers read their cache slices unchanged, and the new keys of all layers
      # are written after the scan: a layer's cache updated inside the scan is copied.
      x, ((k_L, v_L), idx) = jax.lax.scan(
          body, x, (params, cache.k, cache.v, cache.prefix_k, cache.prefix_v))
      new_k, new_v = put(cache.k, key_slot(k_L), -1), put(cache.v, value_slot(v_L), -2)
      experts = () if idx is None else tuple(idx)   # scan_layers: every layer is MoE or none
    else:
      # Unrolled layers write first and read the whole updated buffer: reading the old
      # buffer and then updating it makes XLA copy it.
      new_k, new_v, experts = [], [], []
      for i, layer in enumerate(self.layers):
        x, (k_i, v_i), idx = layer_fn(*nnx.split(layer), x, cache.k[i], cache.v[i],
                                      cache.prefix_k[i], cache.prefix_v[i], write_first=True)
        new_k.append(k_i)
        new_v.append(v_i)
        if idx is not None:
          experts.append(idx)
      new_k, new_v, experts = tuple(new_k), tuple(new_v), tuple(experts)
    cache = cache.replace(k=new_k, v=new_v, index=cache.index + 1)
    hidden_BxGxD = self.final_norm(x).reshape(B, G, -1)
    return (hidden_BxGxD, cache, experts) if with_experts else (hidden_BxGxD, cache)

  def _check_replay(self, replay):
    if replay is not None and len(replay) != self.cfg.num_moe_layers:
      raise ValueError(f"replay must hold one (B, S, K) index array per MoE layer "
                       f"({self.cfg.num_moe_layers}); got {len(replay)}")


def _put_rows(buf: Array, x: Array, index_BxG: Array, slot_axis: int) -> Array:
  """`buf` with one token's keys or values `x` (slot axis of size 1) written at each row's
  own slot `index_BxG`: a select over the slots (a scatter would copy the cache on CPU).
  buf: (..., B, G, C, H, T) or (..., B, G, C, T, H) with an optional leading layers axis."""
  T = buf.shape[slot_axis]
  hit_BxGxT = jnp.arange(T)[None, None] == index_BxG[..., None]
  shape = [1] * buf.ndim
  lead = buf.ndim - 5
  shape[lead], shape[lead + 1], shape[buf.ndim + slot_axis] = buf.shape[lead:lead + 2] + (T,)
  hit = hit_BxGxT.reshape(shape)
  return jnp.where(hit, x.astype(buf.dtype), buf)


def create(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """Build a model with its initialisation compiled as one program (fast on CPU)."""
  return nnx.jit(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))()
