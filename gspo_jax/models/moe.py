"""Mixture-of-experts feed-forward block, exactly as Hugging Face Qwen3-MoE (dropless, top-k).

Shapes: the package legend (docs/shapes.md) (B the model's leading axis);
this module's own: n = B*S tokens, a = n*K token-to-expert assignments.

  logits_nxE = x_nxD @ router_DxE                      (compute dtype, no bias)
  probs_nxE  = softmax(float32(logits)) over ALL E experts   (float64 in float64 runs)
  w_nxK, e_nxK = top_k(probs, K); if norm_topk_prob: w /= sum_k w   (then cast to compute dtype)
  y_n = sum_k w_nk * down_e(silu(x_n @ gate_e) * (x_n @ up_e)),   e = e_nk
  aux = E * sum_e f_e * P_e   (Switch load balancing, float32, over valid tokens only)
        f_e = #{(n, k): e_nk = e} / #tokens   (so sum_e f_e = K),  P_e = mean_n probs_ne

Every token goes to exactly K experts (no capacity, nothing dropped), so this matches HF;
a capacity-factor dispatch would not. Two interchangeable dispatch paths (cfg.moe_dispatch):
  "dense":  every expert runs on every token; an [n, E] combine matrix keeps the chosen
            ones. Exact and simple, E/K times the FLOPs: the test reference, fine for small E.
  "ragged": assignments sorted by expert, jax.lax.ragged_dot per expert group, unsorted.
            K/E of the dense FLOPs; the one for real sizes (preset qwen3_30b_a3b: E=128, K=8).

Expert parallelism (a program traced on a mesh with `mesh.expert` > 1, `sharding.on_mesh`):
the experts are split over the `expert` mesh axis (E/ep per chip, their residual width
still split over `fsdp` at rest) and the tokens go to the chips that hold their experts
(`_expert_parallel`): each chip all-gathers the tokens of its expert group (the ep chips
that differ only in their `expert` coordinate), runs the same dispatch on its own experts
only, and a reduce-scatter sums each token's K expert outputs back onto the chip that
holds the token (in a sampler the group is fsdp x expert, whole experts per chip:
`expert_mesh`). Still dropless and exact (only the float summation order of a token's K
outputs changes: partial sums per chip, then across chips). Per chip and layer this sends
2 (ep-1) n_l D values (n_l tokens per chip) against 2 K (ep-1)/ep n_l D for a dropless
all-to-all of the K copies: fewer bytes while ep < K, as many at ep = K. (A dropless
`ragged_all_to_all` would win past ep = K; XLA:CPU cannot run it, so nothing here could
test it.) The router and the balancing loss run outside, on the tokens where they are.

Routing Replay (`replay_BxSxK`): use given expert indices (those the old / rollout policy
chose) instead of the router's top-k; the weights are still the current router's
probabilities at those experts, so the router keeps its gradient. This is the workaround
GRPO needs to stay stable on MoE models, and the baseline the GSPO paper compares against:
GSPO's sequence-level ratio makes it unnecessary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import param
from gspo_jax.parallel import expert_mesh, sharding
from gspo_jax.utils import checks

Array = jax.Array


def _router_dtype(dtype) -> jnp.dtype:
  """float32, or float64 when the compute dtype is float64."""
  return jnp.promote_types(dtype, jnp.float32)


def route(x_nxD: Array, router_DxE: Array, k: int, *, norm_topk_prob: bool,
          replay_nxK: Array | None = None) -> tuple[Array, Array, Array]:
  """Router: returns (weights_nxK in x's dtype, indices_nxK int32, probs_nxE float32).

  logits = x @ router in x's dtype; probs = softmax(float32 logits) over all experts (float64,
  and so probs_nxE, in float64 runs); indices = top_k(probs) or `replay_nxK`; weights = probs
  at those indices, divided by their sum when `norm_topk_prob`.
  Out-of-range replay indices (negative ones included) give NaN weights (take_along_axis
  "fill" mode), so under jit, where MoE cannot check values, a bad replay shows up as NaN in
  that token's output instead of routing silently.
  """
  logits_nxE = x_nxD @ router_DxE.astype(x_nxD.dtype)
  # HF takes the softmax in float32 whatever the model dtype: bf16 probabilities would make
  # near-ties in the top-k (and the aux loss) depend on rounding. float64 runs keep float64
  # (promote, never demote), so they can check the rest of the block to 1e-12.
  probs_nxE = jax.nn.softmax(logits_nxE.astype(_router_dtype(x_nxD.dtype)), axis=-1)
  if replay_nxK is None:
    weights_nxK, indices_nxK = jax.lax.top_k(probs_nxE, k)
  else:
    indices_nxK = replay_nxK.astype(jnp.int32)
    weights_nxK = jnp.take_along_axis(probs_nxE, indices_nxK, axis=-1, mode="fill",
                                      wrap_negative_indices=False)
  if norm_topk_prob:
    weights_nxK = weights_nxK / jnp.sum(weights_nxK, axis=-1, keepdims=True)
  return weights_nxK.astype(x_nxD.dtype), indices_nxK.astype(jnp.int32), probs_nxE


def _expert_mlp_dense(x_nxD: Array, gate_ExDxF: Array, up_ExDxF: Array,
                      down_ExFxD: Array) -> Array:
  """y_nxExD[n, e] = down_e(silu(x_n @ gate_e) * (x_n @ up_e)) for every (token, expert)."""
  g_nxExF = jnp.einsum("nd,edm->nem", x_nxD, gate_ExDxF)
  u_nxExF = jnp.einsum("nd,edm->nem", x_nxD, up_ExDxF)
  return jnp.einsum("nem,emd->ned", jax.nn.silu(g_nxExF) * u_nxExF, down_ExFxD)


def _dense_dispatch(x_nxD: Array, weights_nxK: Array, indices_nxK: Array, gate_ExDxF: Array,
                    up_ExDxF: Array, down_ExFxD: Array) -> Array:
  """Reference: all experts on all tokens, y_n = sum_e combine_ne * y_ne.

  combine_nxE = sum_k one_hot(e_nk) * w_nk is zero for unchosen experts. The weight is applied
  after `down`, as HF does, so the rounding order matches HF and the ragged path.
  """
  E = gate_ExDxF.shape[0]
  combine_nxE = jnp.sum(jax.nn.one_hot(indices_nxK, E, dtype=weights_nxK.dtype)
                        * weights_nxK[:, :, None], axis=1)
  y_nxExD = _expert_mlp_dense(x_nxD, gate_ExDxF, up_ExDxF, down_ExFxD)
  return jnp.einsum("ned,ne->nd", y_nxExD, combine_nxE)


def _ragged_dispatch(x_nxD: Array, weights_nxK: Array, indices_nxK: Array, gate_ExDxF: Array,
                     up_ExDxF: Array, down_ExFxD: Array) -> Array:
  """Sort the a = n*K assignments by expert, one ragged_dot per weight, unsort, weight-sum.

  Static shapes throughout: the a sorted rows are split into E contiguous groups whose
  sizes (bincount, length E, zeros allowed) are data, not shapes, so this jits and grads.
  """
  n, K = indices_nxK.shape
  E = gate_ExDxF.shape[0]
  expert_a = indices_nxK.reshape(n * K)
  # Bad (out-of-range) replay indices cannot shift other tokens' groups: jnp.bincount counts
  # negatives as 0 (they also sort first, into expert 0's group) and drops values >= E (they
  # sort last, past every group, and come out as zero rows). Their NaN weight flags them.
  # Stable sort: within one expert the rows keep token order (deterministic, like HF's loop).
  order_a = jnp.argsort(expert_a, stable=True)
  sizes_E = jnp.bincount(expert_a, length=E).astype(jnp.int32)
  xs_axD = x_nxD[order_a // K]  # assignment a = n*K + k belongs to token n
  g_axF = jax.lax.ragged_dot(xs_axD, gate_ExDxF, sizes_E)
  u_axF = jax.lax.ragged_dot(xs_axD, up_ExDxF, sizes_E)
  ys_axD = jax.lax.ragged_dot(jax.nn.silu(g_axF) * u_axF, down_ExFxD, sizes_E)
  # Unsort with the inverse permutation (a gather; its gradient is a scatter-add).
  y_nxKxD = ys_axD[jnp.argsort(order_a)].reshape(n, K, -1)
  return jnp.einsum("nkd,nk->nd", y_nxKxD, weights_nxK)


_DISPATCH = {"dense": _dense_dispatch, "ragged": _ragged_dispatch}


def _expert_parallel(dispatch, x_nxD: Array, weights_nxK: Array, indices_nxK: Array,
                     gate_ExDxF: Array, up_ExDxF: Array, down_ExFxD: Array) -> Array:
  """`dispatch` with the experts split over the expert group of the traced program's mesh
  (`expert_mesh.expert_group`; see the module docstring); the arguments and result of
  `_DISPATCH[...]`.

  One shard_map over the whole mesh. Per chip: tokens x_lxD (its rows), expert weights
  (E/ep, D/fsdp, F) as they rest; their fsdp shards are all-gathered inside (the gradient
  is then reduce-scattered back to them; across `data` it is summed). In a sampler the
  group is fsdp x expert and each chip holds E/(fsdp*ep) whole experts (moved there once
  per call, `expert_mesh.place_experts`): a decode step then moves tokens only. Tokens whose
  experts lie on other chips get index E/ep: past every local group (ragged) or outside
  one_hot (dense), so they add exact zeros, and a NaN weight (bad replay) still shows.
  Rows are padded to a multiple of the batch ways (zero rows, weight 0) and cut after.
  """
  mesh = jax.sharding.get_abstract_mesh()
  rows, group = sharding.batch_axes(mesh), expert_mesh.expert_group(mesh)
  n, ways = x_nxD.shape[0], math.prod(mesh.shape[a] for a in rows)
  pad = lambda a: jnp.pad(a, [(0, -n % ways)] + [(0, 0)] * (a.ndim - 1))
  E_local = gate_ExDxF.shape[0] // math.prod(mesh.shape[a] for a in group)
  width = None if "fsdp" in group else "fsdp"   # whole experts (a sampler): nothing to gather

  def local(x_lxD, w_lxK, e_lxK, gate, up, down):
    if width:
      gather = lambda a, axis: jax.lax.all_gather(a, "fsdp", axis=axis, tiled=True)
      gate, up, down = gather(gate, 1), gather(up, 1), gather(down, 2)
    x_mxD, w_mxK, e_mxK = (jax.lax.all_gather(a, group, tiled=True)
                           for a in (x_lxD, w_lxK, e_lxK))
    mine_mxK = e_mxK - jax.lax.axis_index(group) * E_local
    mine_mxK = jnp.where((mine_mxK >= 0) & (mine_mxK < E_local), mine_mxK, E_local)
    y_mxD = _DISPATCH[dispatch](x_mxD, w_mxK, mine_mxK, gate, up, down)
    return jax.lax.psum_scatter(y_mxD, group, tiled=True)

  spec_in, spec_out = P(group, width, None), P(group, None, width)
  y_nxD = jax.shard_map(local, mesh=mesh, out_specs=P(rows),
                        in_specs=(P(rows), P(rows), P(rows), spec_in, spec_in, spec_out))(
      pad(x_nxD), pad(weights_nxK), pad(indices_nxK), gate_ExDxF, up_ExDxF, down_ExFxD)
  return y_nxD[:n]


def load_balancing_loss(probs_nxE: Array, indices_nxK: Array, valid_n: Array) -> Array:
  """Switch / HF load balancing E * sum_e f_e * P_e, padding excluded; a float32 scalar.

  f_e = (assignments of valid tokens to e) / #valid, P_e = sum of probs over valid tokens / #valid.
  Balanced routing gives ~K; all K on the same experts everywhere gives up to E. The count is
  clamped to 1 so a fully padded batch gives 0, not NaN. f_e carries no gradient (it counts),
  so the router learns through P_e. Under Routing Replay f_e counts the replayed (used) experts.
  """
  E, dtype = probs_nxE.shape[-1], probs_nxE.dtype
  valid_n = valid_n.astype(dtype)
  count = jnp.maximum(jnp.sum(valid_n), 1.0)
  assigned_nxKxE = jax.nn.one_hot(indices_nxK, E, dtype=dtype)
  f_E = jnp.sum(assigned_nxKxE * valid_n[:, None, None], axis=(0, 1)) / count
  P_E = jnp.sum(probs_nxE * valid_n[:, None], axis=0) / count
  return (E * jnp.sum(f_E * P_E)).astype(jnp.float32)


def _check_replay(replay: Array, shape: tuple[int, int, int], num_experts: int) -> None:
  """Shape and dtype at trace time; the index range only when the data is concrete."""
  checks.check_shape("MoE", "replay_BxSxK", replay, shape, "(B, S, experts_per_token)")
  if not jnp.issubdtype(jnp.result_type(replay), jnp.integer):
    raise ValueError(f"MoE: replay_BxSxK must hold integer expert indices; "
                     f"got dtype {jnp.result_type(replay)}")
  if checks.is_concrete(replay):
    values = np.asarray(replay)
    if values.size and (values.min() < 0 or values.max() >= num_experts):
      raise ValueError(f"MoE: replay_BxSxK must lie in [0, {num_experts}) (num_experts); "
                       f"got min {values.min()}, max {values.max()}")


class MoE(nnx.Module):
  """Qwen3-MoE sparse block: router + E SwiGLU experts, top-K, dropless.

  Parameters (logical axes): router (D, E) ("embed", "expert"); gate, up (E, D, F)
  ("expert", "embed", "mlp"); down (E, F, D) ("expert", "mlp", "embed"). The router has no
  bias; there are no shared experts (Qwen2-MoE had them, Qwen3-MoE does not).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if cfg.num_experts <= 0:
      raise ValueError(f"MoE needs cfg.num_experts > 0; got {cfg.num_experts}")
    checks.check_choice("MoE", "cfg.moe_dispatch", cfg.moe_dispatch, tuple(_DISPATCH))
    self.hidden = cfg.hidden
    self.num_experts = cfg.num_experts
    self.experts_per_token = cfg.experts_per_token
    self.norm_topk_prob = cfg.norm_topk_prob
    self.dispatch = cfg.moe_dispatch
    self.dtype = jnp.dtype(cfg.dtype)
    pdtype = jnp.dtype(cfg.param_dtype)
    D, E, F = cfg.hidden, cfg.num_experts, cfg.moe_mlp_dim
    self.router = param(rngs, (D, E), ("embed", "expert"), pdtype)
    # fan_in is the contracted width, not shape[0] = E (std would be sqrt(D/E) times too big).
    self.gate = param(rngs, (E, D, F), ("expert", "embed", "mlp"), pdtype, fan_in=D)
    self.up = param(rngs, (E, D, F), ("expert", "embed", "mlp"), pdtype, fan_in=D)
    self.down = param(rngs, (E, F, D), ("expert", "mlp", "embed"), pdtype, fan_in=F)

  def __call__(self, x_BxSxD: Array, *, valid_BxS: Array | None = None,
               replay_BxSxK: Array | None = None) -> tuple[Array, Array, Array]:
    """Returns (y_BxSxD in the compute dtype, indices_BxSxK int32, aux_loss float32 scalar).

    valid_BxS (bool or 0/1, None = all valid) only masks the aux-loss statistics: padded
    tokens are still routed and computed (their outputs are ignored downstream).
    replay_BxSxK: forced expert indices (Routing Replay); the returned indices are the ones
    used, so feeding them back reproduces the output.
    """
    checks.check_rank("MoE", "x_BxSxD", x_BxSxD, 3, "B, S, D")
    B, S, D = x_BxSxD.shape
    if D != self.hidden:
      raise ValueError(f"MoE: x_BxSxD last dim must be hidden={self.hidden}; got {D}")
    K, n = self.experts_per_token, B * S
    if replay_BxSxK is not None:
      _check_replay(replay_BxSxK, (B, S, K), self.num_experts)
    if valid_BxS is None:
      valid_n = jnp.ones((n,), bool)
    else:
      checks.check_shape("MoE", "valid_BxS", valid_BxS, (B, S), "x_BxSxD[..., 0]")
      checks.check_mask("MoE", "valid_BxS", valid_BxS)
      valid_n = jnp.asarray(valid_BxS).reshape(n) != 0
    x_nxD = x_BxSxD.reshape(n, D).astype(self.dtype)
    replay_nxK = None if replay_BxSxK is None else jnp.asarray(replay_BxSxK).reshape(n, K)
    weights_nxK, indices_nxK, probs_nxE = route(
        x_nxD, self.router[...], K, norm_topk_prob=self.norm_topk_prob, replay_nxK=replay_nxK)
    experts = [w[...].astype(self.dtype) for w in (self.gate, self.up, self.down)]
    if expert_mesh.expert_parallel():
      y_nxD = _expert_parallel(self.dispatch, x_nxD, weights_nxK, indices_nxK, *experts)
    else:
      y_nxD = _DISPATCH[self.dispatch](x_nxD, weights_nxK, indices_nxK, *experts)
    aux = load_balancing_loss(probs_nxE, indices_nxK, valid_n)
    return y_nxD.reshape(B, S, D), indices_nxK.reshape(B, S, K), aux
