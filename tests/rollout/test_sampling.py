"""The in-graph group sampler: log-prob parity with teacher forcing, shared prefix vs
repeated prompts, EOS/padding, variable prompt lengths, filters, determinism, bad input; the
recorded log-probs are those of the unfiltered distribution.

Each SamplerConfig (and prompt shape) is a separate cold compile of the whole sampler, so
tests reuse a few configs (greedy with G=2, BASE) where the group size does not matter.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax.models import config, transformer
from gspo_jax.rollout import sampling
from gspo_jax.rollout.sampling import SamplerConfig, sample_groups
from gspo_jax.rollout.teacher_forcing import response_logprobs
from tests.helpers import compiled_sampler, loop_copies

VOCAB = 64
EOS = 1


@pytest.fixture(scope="module")
def model():
  return transformer.create(config.tiny(), seed=3)


@pytest.fixture(scope="module")
def moe_model():
  return transformer.create(config.tiny_moe(), seed=4)


def ragged_twin(moe_model):
  """The same parameters with moe_dispatch="ragged" (no second initialisation compile)."""
  abstract = nnx.eval_shape(
      lambda: transformer.Transformer(config.tiny_moe(moe_dispatch="ragged"), rngs=nnx.Rngs(0)))
  return nnx.merge(nnx.graphdef(abstract), nnx.state(moe_model))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  p = rng.integers(2, VOCAB, (3, 6)).astype(np.int32)
  lens = np.array([6, 2, 4], np.int32)
  p[np.arange(6)[None, :] >= lens[:, None]] = 0
  return jnp.asarray(p), jnp.asarray(lens)


teacher = nnx.jit(response_logprobs, static_argnames=("temperature",))

BASE = SamplerConfig(group_size=4, max_new_tokens=8, eos_id=EOS, max_prompt_len=16)


@pytest.mark.parametrize("which,temperature", [("dense", 1.0), ("dense", 0.7), ("moe", 1.0),
                                               ("moe_ragged", 1.0)])
def test_sampler_logprobs_equal_teacher_forced(which, temperature, model, moe_model, prompts):
  m = {"dense": model, "moe": moe_model}.get(which) or ragged_twin(moe_model)
  if which.startswith("moe"):
    assert m.layers[0].mlp.dispatch == ("ragged" if which == "moe_ragged" else "dense")
  cfg = dataclasses.replace(BASE, temperature=temperature)
  r = sample_groups(m, *prompts, jax.random.key(0), cfg)
  lp, _ = teacher(m, *prompts, r.tokens_BxGxT, temperature=temperature)
  mask = np.asarray(r.mask_BxGxT)
  assert mask.sum() > 0
  np.testing.assert_allclose(np.asarray(lp) * mask, r.logp_BxGxT, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_decode_phases_draw_what_one_phase_draws_and_never_copy_the_cache(
    which, model, moe_model, prompts):
  # BASE decodes in one phase over a cache of all T = 8 slots; caches of 3, then 6, then 8
  # slots only add or drop masked slots, whose softmax weights are exact zeros.
  m = model if which == "dense" else moe_model
  assert sampling.decode_windows(8, BASE.decode_window) == (8,)
  phased = dataclasses.replace(BASE, decode_window=3)
  assert sampling.decode_windows(8, 3) == (3, 6, 8)
  want = sample_groups(m, *prompts, jax.random.key(2), BASE)
  got, hlo = compiled_sampler(m, prompts, jax.random.key(2), phased)
  np.testing.assert_array_equal(got.tokens_BxGxT, want.tokens_BxGxT)
  # float32 summation order differs between the two decode loops' programs (1.4e-6 seen
  # with jax 0.12 on an Intel Xeon): the tokens above are equal exactly.
  np.testing.assert_allclose(got.logp_BxGxT, want.logp_BxGxT, rtol=0, atol=1e-5)
  assert int(got.steps) == int(want.steps)
  # The cache is written in place: no decode step copies it (XLA inserts such copies when
  # a loop reads a buffer it also updates in a way it cannot order).
  B, G = got.tokens_BxGxT.shape[:2]
  assert loop_copies(hlo, B, G, m.cfg.num_kv_heads, m.cfg.head_dim, (3, 6, 8)) == []


def test_bf16_cache_logprobs_within_tolerance_of_teacher_forcing(model, moe_model, prompts):
  # Keys and values stored in bfloat16 (relative rounding 2^-9), attention in float32: the
  # sampler's log-probs of its own tokens stay within 0.005 on average of teacher forcing's
  # (float32 throughout), 0.03 at most for the dense model; MoE routing can flip at a
  # near-tie, hence 0.1 at most there. Over 0 on purpose: the cache is rounded.
  cfg = dataclasses.replace(BASE, cache_dtype="bfloat16", decode_window=4)
  for m, worst in ((model, 0.03), (moe_model, 0.1)):
    r = sample_groups(m, *prompts, jax.random.key(0), cfg)
    lp, _ = teacher(m, *prompts, r.tokens_BxGxT, temperature=1.0)
    mask = np.asarray(r.mask_BxGxT)
    diff = np.abs(np.asarray(lp) * mask - np.asarray(r.logp_BxGxT))
    assert 1e-4 < diff.max() < worst and diff[mask > 0].mean() < 0.005


def test_bf16_cache_of_a_float64_model_is_refused():
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    m = nnx.eval_shape(lambda: transformer.Transformer(
        config.tiny(dtype="float64", param_dtype="float64"), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"cache_dtype='bfloat16'.*float64"):
      sample_groups(m, jnp.ones((1, 3), jnp.int32), jnp.asarray([3]), jax.random.key(0),
                    dataclasses.replace(BASE, cache_dtype="bfloat16"))
  finally:
    jax.config.update("jax_enable_x64", previous)


def test_responses_beyond_the_models_positions_are_refused():
  m = nnx.eval_shape(lambda: transformer.Transformer(config.tiny(max_positions=8),
                                                     rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"P \+ SamplerConfig.max_new_tokens = 3 \+ 6 .*"
                                       r"ModelConfig.max_positions = 8"):
    sample_groups(m, jnp.ones((1, 3), jnp.int32), jnp.asarray([3]), jax.random.key(0),
                  dataclasses.replace(BASE, max_new_tokens=6))


def test_shared_prefix_equals_repeated_prompts(model, prompts):
  p, lens = prompts
  G = 2  # the greedy config of the padding test: one sampler compile less
  greedy = dataclasses.replace(BASE, group_size=G, greedy=True)
  shared = sample_groups(model, p, lens, jax.random.key(1), greedy)
  repeated = sample_groups(model, jnp.repeat(p, G, 0), jnp.repeat(lens, G),
                           jax.random.key(1), dataclasses.replace(greedy, group_size=1))
  np.testing.assert_array_equal(shared.tokens_BxGxT.reshape(-1, 8), repeated.tokens_BxGxT[:, 0])
  np.testing.assert_allclose(shared.logp_BxGxT.reshape(-1, 8), repeated.logp_BxGxT[:, 0],
                             rtol=1e-5, atol=1e-5)
  # Sampled (not greedy) tokens of the shared sampler (BASE: G = 4), scored on the repeated path.
  sampled = sample_groups(model, p, lens, jax.random.key(2), BASE)
  lp, _ = teacher(model, p, lens, sampled.tokens_BxGxT)
  np.testing.assert_allclose(np.asarray(lp) * np.asarray(sampled.mask_BxGxT), sampled.logp_BxGxT,
                             rtol=1e-5, atol=1e-5)


def test_eos_ends_responses_and_nothing_after_counts(model, prompts):
  # Greedy, so every response of a group is the same: response 0 is checked. G = 2 as in
  # the early-exit test (one sampler compile less).
  greedy = dataclasses.replace(BASE, greedy=True, group_size=2, eos_id=VOCAB - 1)
  free = sample_groups(model, *prompts, jax.random.key(0), greedy)
  tokens = np.asarray(free.tokens_BxGxT)[:, 0]
  # Make row 0's third greedy token the EOS: row 0 must stop there; others at their first one.
  eos = int(tokens[0, 2])
  r = sample_groups(model, *prompts, jax.random.key(0), dataclasses.replace(greedy, eos_id=eos))
  out_tok, mask = np.asarray(r.tokens_BxGxT)[:, 0], np.asarray(r.mask_BxGxT)[:, 0]
  for b in range(3):
    hits = np.flatnonzero(tokens[b] == eos)
    n = hits[0] + 1 if hits.size else 8
    np.testing.assert_array_equal(out_tok[b, :n], tokens[b, :n])  # same prefix as before
    np.testing.assert_array_equal(mask[b], np.arange(8) < n)
    assert np.all(out_tok[b, n:] == greedy.pad_id)
    assert np.all(np.asarray(r.logp_BxGxT)[b, 0, n:] == 0)
    assert int(r.lengths_BxG[b, 0]) == n
    assert bool(r.eos_BxG[b, 0]) == bool(hits.size) and bool(r.truncated_BxG[b, 0]) != bool(hits.size)
  assert bool(r.eos_BxG[0, 0]) and int(r.lengths_BxG[0, 0]) <= 3


def test_early_exit_when_all_responses_end(model, prompts):
  greedy = dataclasses.replace(BASE, greedy=True, group_size=2, eos_id=VOCAB - 1)
  first = np.asarray(sample_groups(model, *prompts, jax.random.key(0), greedy).tokens_BxGxT)
  # With every row's first greedy token as EOS... rows differ, so pick a prompt set whose
  # first tokens agree: repeat row 0.
  p, lens = prompts
  same = (jnp.repeat(p[:1], 3, 0), jnp.repeat(lens[:1], 3))
  eos = int(first[0, 0, 0])
  r = sample_groups(model, *same, jax.random.key(0), dataclasses.replace(greedy, eos_id=eos))
  assert int(r.steps) == 1 and np.all(np.asarray(r.lengths_BxG) == 1)
  assert np.all(np.asarray(r.tokens_BxGxT)[:, :, 1:] == 0)
  full = sample_groups(model, *prompts, jax.random.key(0), greedy)
  assert int(full.steps) == 8 or np.all(np.asarray(full.eos_BxG))


def test_prompt_padding_and_batch_neighbours_change_nothing(model, prompts):
  p, lens = prompts
  greedy = dataclasses.replace(BASE, greedy=True, group_size=2)
  base = sample_groups(model, p, lens, jax.random.key(0), greedy)
  # More padding columns, filled with junk beyond each prompt's length.
  junk = jnp.concatenate([p, jnp.full((3, 5), 7, jnp.int32)], axis=1)
  junk = jnp.where(jnp.arange(11)[None, :] < lens[:, None], junk, 9)
  padded = sample_groups(model, junk, lens, jax.random.key(0), greedy)
  np.testing.assert_array_equal(padded.tokens_BxGxT, base.tokens_BxGxT)
  np.testing.assert_allclose(padded.logp_BxGxT, base.logp_BxGxT, rtol=1e-5, atol=1e-5)
  # A row alone gives what it gave in the batch.
  alone = sample_groups(model, p[1:2, :2], lens[1:2], jax.random.key(0), greedy)
  np.testing.assert_array_equal(alone.tokens_BxGxT[0], base.tokens_BxGxT[1])


def test_deterministic_per_key(model, prompts):
  a = sample_groups(model, *prompts, jax.random.key(5), BASE)
  b = sample_groups(model, *prompts, jax.random.key(5), BASE)
  c = sample_groups(model, *prompts, jax.random.key(6), BASE)
  np.testing.assert_array_equal(a.tokens_BxGxT, b.tokens_BxGxT)
  assert not np.array_equal(np.asarray(a.tokens_BxGxT), np.asarray(c.tokens_BxGxT))
  # The G responses of one prompt differ (independent draws from the same prefix).
  t = np.asarray(a.tokens_BxGxT)
  assert any(not np.array_equal(t[b, 0], t[b, g]) for b in range(3) for g in range(1, 4))


def test_filters_hand_values():
  logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
  neg = jnp.finfo(jnp.float32).min
  keep = lambda cfg: np.asarray(sampling.filter_logits(logits, cfg)[0] > neg)
  c = dataclasses.replace(BASE, top_k=2)
  np.testing.assert_array_equal(keep(c), [1, 1, 0, 0, 0])
  # top_p = 0.8: masses before each token 0, .5, .7, .85 -> keep the first three.
  np.testing.assert_array_equal(keep(dataclasses.replace(BASE, top_p=0.8)), [1, 1, 1, 0, 0])
  np.testing.assert_array_equal(keep(dataclasses.replace(BASE, top_p=0.01)), [1, 0, 0, 0, 0])
  np.testing.assert_array_equal(keep(dataclasses.replace(BASE, vocab_limit=3)), [1, 1, 1, 0, 0])


def test_first_argmax_and_pick_equal_argmax_and_categorical():
  rng = np.random.default_rng(5)
  x = rng.normal(size=(3, 4, 50)).astype(np.float32)
  x[0, 0, [3, 7, 40]] = 9.0           # ties: the first index wins, as in argmax
  x[1, :, 10:] = np.finfo(np.float32).min  # filtered-out entries
  np.testing.assert_array_equal(sampling.first_argmax(jnp.asarray(x)), np.argmax(x, -1))
  assert int(sampling.first_argmax(jnp.asarray([1.0, np.nan, 2.0]))) == 2  # NaN: a valid index
  # Sampling: the same Gumbel noise as jax.random.categorical, hence the same tokens.
  cfg = dataclasses.replace(BASE, temperature=0.7)
  for seed in range(5):
    key = jax.random.key(seed)
    token, _, _ = sampling.pick_token(jnp.asarray(x), key, cfg)
    np.testing.assert_array_equal(token, jax.random.categorical(key, jnp.asarray(x) / 0.7))


def test_top_k_one_is_greedy_and_vocab_limit_holds(model, prompts):
  # G = 2: the greedy config of the padding test (one sampler compile less).
  greedy = sample_groups(model, *prompts, jax.random.key(0),
                         dataclasses.replace(BASE, greedy=True, group_size=2))
  k1 = sample_groups(model, *prompts, jax.random.key(9),
                     dataclasses.replace(BASE, top_k=1, group_size=2))
  np.testing.assert_array_equal(k1.tokens_BxGxT, greedy.tokens_BxGxT)
  limited = sample_groups(model, *prompts, jax.random.key(3),
                          dataclasses.replace(BASE, vocab_limit=20, temperature=3.0))
  toks = np.asarray(limited.tokens_BxGxT)[np.asarray(limited.mask_BxGxT) > 0]
  assert toks.max() < 20


@pytest.mark.parametrize("kw,match", [
    (dict(group_size=0), "group_size"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(decode_window=0), "decode_window"),
    (dict(cache_dtype="float16"), "cache_dtype"),
])
def test_bad_sampler_config(kw, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(BASE, **kw)


def test_greedy_allows_zero_temperature():
  assert dataclasses.replace(BASE, greedy=True, temperature=0.0).greedy


def test_bad_prompts(model):
  cfg = dataclasses.replace(BASE, max_prompt_len=4)
  with pytest.raises(ValueError, match="max_prompt_len"):
    sample_groups(model, jnp.ones((2, 5), jnp.int32), jnp.asarray([5, 3]), jax.random.key(0), cfg)
  with pytest.raises(ValueError, match="empty prompt"):
    sample_groups(model, jnp.ones((2, 3), jnp.int32), jnp.asarray([3, 0]), jax.random.key(0), cfg)
  with pytest.raises(ValueError, match="prompt_lens_B"):
    sample_groups(model, jnp.ones((2, 3), jnp.int32), jnp.asarray([3]), jax.random.key(0), cfg)
  with pytest.raises(ValueError, match="prompts_BxP"):
    sample_groups(model, jnp.ones((3,), jnp.int32), jnp.asarray([3]), jax.random.key(0), cfg)


def test_entropy_is_that_of_the_tempered_distribution(model, prompts):
  p, lens = prompts
  cfg = dataclasses.replace(BASE, temperature=0.7)
  r = sample_groups(model, p, lens, jax.random.key(4), cfg)
  # First response token: the distribution after the last prompt token, same for all G.
  out = nnx.jit(lambda m, t, pos, v: m.logits(m(t, pos, v).hidden_BxSxD))(
      model, p, jnp.broadcast_to(jnp.arange(6), (3, 6)), jnp.arange(6)[None, :] < lens[:, None])
  logp = jax.nn.log_softmax(np.asarray(out)[np.arange(3), np.asarray(lens) - 1] / 0.7, axis=-1)
  want = -np.sum(np.exp(logp) * logp, axis=-1)
  np.testing.assert_allclose(np.asarray(r.entropy_BxGxT)[:, :, 0],
                             np.broadcast_to(want[:, None], (3, 4)), rtol=1e-5, atol=1e-5)
  e, m = np.asarray(r.entropy_BxGxT), np.asarray(r.mask_BxGxT)
  assert np.all(e[m == 0] == 0) and np.all(e[m > 0] > 0) and np.all(e <= np.log(VOCAB) + 1e-5)


def test_sampler_log_probs_are_of_the_unfiltered_distribution():
  """The sampler draws from the filtered distribution (here the first 8 of 64 ids) but
  records the log-probs and entropy of the tempered, unfiltered one, which is what teacher
  forcing recomputes. All logits 0: every counted token has log-prob -log 64 and entropy
  log 64 (the filtered distribution would give -log 8 and log 8)."""
  model = transformer.create(config.tiny(), seed=0)
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, state))
  V = model.cfg.vocab_size
  cfg = SamplerConfig(group_size=2, max_new_tokens=4, eos_id=1, max_prompt_len=4,
                      temperature=0.5, vocab_limit=8)
  out = sample_groups(model, jnp.full((2, 4), 5, jnp.int32), jnp.full((2,), 4, jnp.int32),
                      jax.random.key(0), cfg)
  m = np.asarray(out.mask_BxGxT) > 0
  assert np.asarray(out.tokens_BxGxT)[m].max() < 8
  np.testing.assert_allclose(np.asarray(out.logp_BxGxT)[m], -np.log(V), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(out.entropy_BxGxT)[m], np.log(V), rtol=1e-6)
