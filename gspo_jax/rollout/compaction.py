"""Live-row compaction for the group sampler (`SamplerConfig.compact_rows`).

Shapes: the package legend (docs/shapes.md); n (this module's own) the rows
of a compacted stage.

A decode step costs a fixed part plus a part per row, and the sampler's while loop keeps
decoding rows that have already ended until the longest one ends. With `compact_rows = L`,
each decode phase (`sampling.decode_windows`) runs, after the full-size loop, up to L
stages at n = R/2, R/4, ..., R/2^L rows (rounded up). Stage k runs (a `lax.cond`) when the
live rows fit n_k but not n_{k+1} (any count for k = L): it gathers the live rows (a stable
argsort of `done`: live rows first, in row order), their own response caches and their
prompt's prefix cache rows (prompt b = row // G; the stage decodes n "prompts" of one
response each), runs the decode loop at n rows until the phase ends, every row has ended,
or the live rows fit n_{k+1}, and scatters tokens, caches and flags back. Stages hand over
in order because the live count only falls.

Shapes stay static: the output buffers keep all R rows (the stage writes its rows by
index), and every stage is compiled once per phase: (L + 1) copies of the decode step per
phase. The full-size loop keeps the shared prompt cache (one prefix read per prompt); a
stage reads one prefix copy per row, which is what a stage of at most R/2 rows can afford.
While a stage runs, its n-row cache exists next to the full one (at most 1.5x the cache
memory).

Same draws: the sampler's Gumbel noise at step t is drawn for the whole (B, G, V) array
from fold_in(key, t); a stage draws that same array and takes its rows' noise, so a
compacted row gets exactly the noise it would have had. (Drawing per row would cost less,
but would change the uncompacted sampler's draws.) The model's arithmetic is the same per
row, but not bit for bit: XLA:CPU compiles the n-row decode step (one response per
"prompt") into kernels whose float32 rounding can differ from the B x G step's by ~1e-6 in
the logits (the attention's reductions; measured at cache lengths 4 to 128). So the
log-probs and entropies agree to float32 rounding, and tokens, lengths and `steps` are
equal unless such a difference flips a Gumbel argmax at a near-tie (tests/rollout/test_compaction.py:
equal for dense and MoE models at spread lengths, every row ending at once, none ending).

Expert recording (R3): a stage records its rows' choices into the full buffers. A row
left out of a stage has ended, and the uncompacted sampler would record the router's
choice for the padding it keeps feeding; compaction leaves those slots at experts 0..K-1.
No counted log-prob depends on a slot at or after a row's EOS, so what R3 replays for
counted tokens is unchanged.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from gspo_jax.models.transformer import KVCache

Array = jax.Array


def row_sizes(rows: int, halvings: int) -> tuple[int, ...]:
  """(R, ceil(R/2), ..., ceil(R/2^L)): the row counts of the full loop and each stage."""
  if 2 ** halvings > rows:
    raise ValueError(f"SamplerConfig.compact_rows={halvings} (rollout.compact_rows) halves "
                     f"B*G = {rows} rows below one row: use at most "
                     f"{int(math.log2(rows))} halvings for this batch")
  return tuple(-(-rows // 2 ** k) for k in range(halvings + 1))


@flax.struct.dataclass
class _StageState:
  t: Array                 # next response slot to fill (shared by all rows)
  rows_n: Array            # int32: which of the R rows each stage row is
  last_n: Array            # token sampled at t - 1
  done_n: Array
  tokens_RxT: Array        # the full output buffers, written at rows_n
  logp_RxT: Array
  entropy_RxT: Array
  cache: KVCache           # n prompts of one response each
  experts_RxTxK: tuple[Array, ...] = ()


def _stacked(cache: KVCache) -> bool:
  return not isinstance(cache.k, tuple)


def gather_cache(cache: KVCache, rows_n: Array, group_size: int) -> KVCache:
  """The caches of rows `rows_n` as n prompts with one response each: each row's prompt
  keys (prompt rows_n // G) and its own response keys."""
  lead = 1 if _stacked(cache) else 0   # stacked layers: (L, B, ...)
  prompt_n = rows_n // group_size

  def own(x):  # (..., B, G, rest) -> (..., n, 1, rest)
    flat = x.reshape(x.shape[:lead] + (-1,) + x.shape[lead + 2:])
    return jnp.expand_dims(jnp.take(flat, rows_n, axis=lead), lead + 1)

  prefix = lambda x: jnp.take(x, prompt_n, axis=lead)
  return cache.replace(prefix_k=jax.tree.map(prefix, cache.prefix_k),
                       prefix_v=jax.tree.map(prefix, cache.prefix_v),
                       prefix_valid_BxP=cache.prefix_valid_BxP[prompt_n],
                       k=jax.tree.map(own, cache.k), v=jax.tree.map(own, cache.v))


def scatter_cache(full: KVCache, part: KVCache, rows_n: Array) -> KVCache:
  """`full` with the response caches of rows `rows_n` replaced by `part`'s (prefix kept)."""
  lead = 1 if _stacked(full) else 0

  def put(x, y):
    flat = x.reshape(x.shape[:lead] + (-1,) + x.shape[lead + 2:])
    y = y.reshape(y.shape[:lead] + (-1,) + y.shape[lead + 2:])
    idx = (slice(None),) * lead + (rows_n,)
    return flat.at[idx].set(y).reshape(x.shape)

  return full.replace(k=jax.tree.map(put, full.k, part.k), v=jax.tree.map(put, full.v, part.v),
                      index=part.index)


def _gather(state, rows_n: Array, group_size: int) -> _StageState:
  B, G, T = state.tokens_BxGxT.shape
  flat = lambda x: x.reshape((B * G,) + x.shape[2:])
  return _StageState(t=state.t, rows_n=rows_n, last_n=flat(state.last_BxG)[rows_n],
                     done_n=flat(state.done_BxG)[rows_n], tokens_RxT=flat(state.tokens_BxGxT),
                     logp_RxT=flat(state.logp_BxGxT), entropy_RxT=flat(state.entropy_BxGxT),
                     cache=gather_cache(state.cache, rows_n, group_size),
                     experts_RxTxK=tuple(flat(e) for e in state.experts_BxGxTxK))


def _scatter(state, s: _StageState):
  B, G, T = state.tokens_BxGxT.shape
  back = lambda full, x: full.reshape(B * G).at[s.rows_n].set(x).reshape(B, G)
  grouped = lambda x: x.reshape((B, G) + x.shape[1:])
  return state.replace(t=s.t, last_BxG=back(state.last_BxG, s.last_n),
                       done_BxG=back(state.done_BxG, s.done_n),
                       tokens_BxGxT=grouped(s.tokens_RxT), logp_BxGxT=grouped(s.logp_RxT),
                       entropy_BxGxT=grouped(s.entropy_RxT),
                       cache=scatter_cache(state.cache, s.cache, s.rows_n),
                       experts_BxGxTxK=tuple(grouped(e) for e in s.experts_RxTxK))


def stages(model, state, window: int, sizes: tuple[int, ...], *, prompt_lens_B: Array,
           key: Array, cfg, pick):
  """Run the compacted stages of one decode phase after its full-size loop.

  Args:
    model: the Transformer. state: the sampler's loop state (`sampling._LoopState`, all R
      rows, cache sized to `window`). sizes: `row_sizes(R, cfg.compact_rows)`.
    prompt_lens_B: prompt lengths (positions). key: the sampler's key (step t draws from
      fold_in(key, t)). cfg: the SamplerConfig.
    pick: (logits_nxV, gumbel_nxV | None, cfg) -> (token_n, logp_n, entropy_n), the
      sampler's token choice given its noise.
  Returns:
    The loop state after the phase (or after every row has ended), all R rows.
  """
  B, G, T = state.tokens_BxGxT.shape
  V = model.cfg.vocab_size

  def unfinished(t, done):  # step t writes cache slot t - 1 < window
    return (t < T) & (t <= window) & ~jnp.all(done)

  def body(s: _StageState) -> _StageState:
    n = s.rows_n.shape[0]
    positions_nx1 = (prompt_lens_B[s.rows_n // G] + s.t - 1)[:, None]
    if not cfg.record_experts:
      hidden_nx1xD, cache = model.decode(s.last_n[:, None], positions_nx1, s.cache)
    else:  # token t - 1's choices go to its slot, as in the full-size loop
      hidden_nx1xD, cache, idx = model.decode(s.last_n[:, None], positions_nx1, s.cache,
                                              with_experts=True)
      s = s.replace(experts_RxTxK=tuple(buf.at[s.rows_n, s.t - 1].set(i.reshape(n, -1))
                                        for buf, i in zip(s.experts_RxTxK, idx)))
    noise = None
    if not cfg.greedy:  # the full-size draw of step t, this stage's rows of it
      gumbel_BxGxV = jax.random.gumbel(jax.random.fold_in(key, s.t), (B, G, V), jnp.float32)
      noise = gumbel_BxGxV.reshape(B * G, V)[s.rows_n]
    token_n, logp_n, entropy_n = pick(model.logits(hidden_nx1xD[:, 0]), noise, cfg)
    # As sampling._record: ended rows get pad, log-prob 0 and entropy 0.
    token_n = jnp.where(s.done_n, cfg.pad_id, token_n)
    put = lambda buf, x: buf.at[s.rows_n, s.t].set(jnp.where(s.done_n, 0, x).astype(buf.dtype))
    return s.replace(t=s.t + 1, last_n=token_n, done_n=s.done_n | (token_n == cfg.eos_id),
                     tokens_RxT=s.tokens_RxT.at[s.rows_n, s.t].set(token_n),
                     logp_RxT=put(s.logp_RxT, logp_n), entropy_RxT=put(s.entropy_RxT, entropy_n),
                     cache=cache)

  for k in range(1, len(sizes)):
    below = sizes[k + 1] if k + 1 < len(sizes) else 0   # the next stage takes over there

    def run(state, n=sizes[k], below=below):
      rows_n = jnp.argsort(state.done_BxG.reshape(B * G), stable=True)[:n].astype(jnp.int32)
      cond = lambda s: unfinished(s.t, s.done_n) & (jnp.sum(~s.done_n) > below)
      return _scatter(state, jax.lax.while_loop(cond, body, _gather(state, rows_n, G)))

    live = jnp.sum(~state.done_BxG)
    enter = unfinished(state.t, state.done_BxG) & (live <= sizes[k]) & (live > below)
    state = jax.lax.cond(enter, run, lambda s: s, state)
  return state
