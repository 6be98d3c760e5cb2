"""model.matmul_dtype: weight matmuls with bfloat16 inputs and float32 accumulation.

Hand references: the same contraction of the bfloat16-rounded operands computed in float64.
The backward's two matmuls take bfloat16 operands too (checked in the jaxpr: no float32 x
bfloat16 dot, which XLA:CPU would run in float32), and their results stay float32. At the
model level: sampler log-probs equal teacher-forced ones under the option (one function),
the gap to the float32 model is small but not zero, and a bfloat16 model is unchanged.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gspo_jax.models import config, matmul, transformer
from gspo_jax.models.attention import attend, rounded
from gspo_jax.rollout.sampling import SamplerConfig, sample_groups
from gspo_jax.rollout.teacher_forcing import response_logprobs

BF16 = jnp.bfloat16
SPECS = [("nd,df->nf", (6, 8), (8, 5)), ("bsd,dnh->bsnh", (2, 3, 8), (8, 4, 2)),
         ("bsnh,nhd->bsd", (2, 3, 4, 2), (4, 2, 8)), ("bkd,dv->bkv", (2, 3, 8), (8, 7))]


def rounded64(a):
  return np.asarray(jnp.asarray(a).astype(BF16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("spec,xs,ws", SPECS)
def test_forward_and_both_gradients_are_bf16_products_summed_in_float32(spec, xs, ws):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x, w = jax.random.normal(kx, xs), jax.random.normal(kw, ws)
  y, vjp = jax.vjp(lambda a, b: matmul.einsum(spec, a, b, BF16), x, w)
  dy = jax.random.normal(kd, y.shape)
  dx, dw = vjp(dy)
  assert y.dtype == dx.dtype == dw.dtype == jnp.float32
  lhs, rest = spec.split(",")
  rhs, out = rest.split("->")
  ein = lambda s, a, b: np.einsum(s, a, b)
  np.testing.assert_allclose(y, ein(spec, rounded64(x), rounded64(w)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, ein(f"{out},{rhs}->{lhs}", rounded64(dy), rounded64(w)),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, ein(f"{lhs},{out}->{rhs}", rounded64(x), rounded64(dy)),
                             rtol=1e-5, atol=1e-5)
  # Rounding happened: float32 operands give a different product.
  assert not np.allclose(y, ein(spec, np.asarray(x, np.float64), np.asarray(w, np.float64)),
                         rtol=1e-5, atol=1e-5)


def test_backward_dots_take_bf16_operands_only():
  x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
  jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: matmul.einsum("nd,df->nf", a, b, BF16).sum(),
                                  argnums=(0, 1)))(x, w)
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 3, jaxpr       # forward, dx, dw
  for e in dots:
    assert [v.aval.dtype for v in e.invars] == [BF16, BF16], e
    assert e.outvars[0].aval.dtype == jnp.float32, e


def test_none_is_the_plain_einsum_and_bad_specs_are_named():
  x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
  np.testing.assert_array_equal(matmul.einsum("nd,df->nf", x, w), jnp.einsum("nd,df->nf", x, w))
  with pytest.raises(ValueError, match="not a plain two-operand contraction"):
    matmul.einsum("nd,de->n", x, w, BF16)


def test_varying_axes_reads_what_shard_map_varies_over():
  # The one JAX attribute read without a public name (`matmul.varying_axes`): when a JAX
  # release moves it, this fails here rather than as a wrong gradient inside shard_map.
  mesh = Mesh(np.array(jax.devices()), ("x",))
  seen = []

  def body(a, b):
    seen.append((matmul.varying_axes(a), matmul.varying_axes(b)))
    return a

  x = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P("x")))
  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))(
      x, jnp.ones(2))
  assert seen == [(frozenset({"x"}), frozenset())]
  assert matmul.varying_axes(jnp.ones(2)) == frozenset()


def test_config_values():
  assert config.tiny().matmul is None
  assert config.tiny(matmul_dtype="bfloat16").matmul == jnp.dtype(BF16)
  # A bfloat16 model already multiplies in bfloat16: the option changes nothing there.
  assert config.tiny(dtype="bfloat16", matmul_dtype="bfloat16").matmul is None
  with pytest.raises(ValueError, match="matmul_dtype must be one of"):
    config.tiny(matmul_dtype="float16")
  with pytest.raises(ValueError, match="matmul_dtype is for dense models"):
    config.tiny_moe(matmul_dtype="bfloat16")
  assert "matmul_dtype" in config.EXECUTION_FIELDS


def _decode_inputs(B=2, G=2, P=5, J=6, N=4, C=2, H=8):
  """One decode step's query against shared, own (cache) and new keys, time-first."""
  rng = np.random.default_rng(4)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return dict(q=f(B, G, 1, N, H), pk=f(B, P, C, H), pv=f(B, P, C, H), k=f(B, G, J, C, H),
              v=f(B, G, J, C, H), nk=f(B, G, 1, C, H), nv=f(B, G, 1, C, H),
              pmask=jnp.asarray(np.array([[1, 1, 1, 0, 0], [1] * 5], bool)[:, None, None]),
              kmask=jnp.asarray(np.arange(J) < 4)[None, None, None])


def _attend_both_layouts(x, dtype):
  """The step through the cache's heads-first layouts (its own keys and values rounded as
  `Transformer.decode` writes them) and through the time-first ones."""
  segs = lambda pk, pv, k, v: dict(shared=(pk, pv, x["pmask"]), own=(k, v, x["kmask"]),
                                   new=(x["nk"], x["nv"], True), matmul_dtype=dtype)
  heads_first = attend(x["q"], heads_first=True, **segs(
      jnp.swapaxes(x["pk"], 1, 2), jnp.swapaxes(x["pv"], 1, 2),      # (B, C, P, H)
      rounded(jnp.moveaxis(x["k"], 2, -1), dtype),                   # (B, G, C, H, J)
      rounded(jnp.swapaxes(x["v"], 2, 3), dtype)))                   # (B, G, C, J, H)
  return heads_first, attend(x["q"], **segs(x["pk"], x["pv"], x["k"], x["v"]))


def test_attention_products_take_bf16_inputs_on_every_path():
  # A decode step reads the cache's layouts, teacher forcing the time-first ones: under
  # the option both round q, k, the probabilities and v to bfloat16 (products exact in
  # float32), so they agree to float32 summation order, and differ from float32. A
  # summation-order difference may move a probability to its neighbouring bfloat16 value
  # (2^-8 relative) on some CPU: the layouts must agree within 1e-3, far inside a path
  # that does not round (~5e-3 from the other here).
  x = _decode_inputs()
  both = jax.jit(_attend_both_layouts, static_argnums=1)
  reduce_bf, einsum_bf = both(x, BF16)
  reduce_32, einsum_32 = both(x, None)
  np.testing.assert_allclose(reduce_bf, einsum_bf, rtol=0, atol=1e-3)
  np.testing.assert_allclose(reduce_32, einsum_32, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(einsum_bf - einsum_32))) > 1e-4
  # Every dot of the attention, forward and backward, takes bfloat16 operands.
  loss = lambda q, k: jnp.sum(attend(q, own=(k, x["v"], x["kmask"]), matmul_dtype=BF16))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x["q"], x["k"])
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  dots += [e for eq in jaxpr.jaxpr.eqns for sub in jaxprs_in_params(eq.params)
           for e in sub.eqns if e.primitive.name == "dot_general"]
  assert len(dots) >= 6, jaxpr  # two products, each with two backward matmuls
  for e in dots:
    assert [v.aval.dtype for v in e.invars] == [BF16, BF16], e


def twin(model, **overrides):
  """`model`'s parameters under a config with `overrides` (execution fields only)."""
  cfg = dataclasses.replace(model.cfg, **overrides)
  abstract = nnx.eval_shape(lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  return nnx.merge(nnx.graphdef(abstract), nnx.state(model))


@pytest.mark.parametrize("rows,group,new", [(3, 2, 6), (8, 4, 4)])
def test_model_sampler_equals_teacher_forcing_and_gap_to_float32_is_small(rows, group, new):
  # (8, 4, 4): the shape at which decode's attention by multiply-and-reduce over rounded
  # inputs once gave log-probs 2e-2 away from teacher forcing's. Tolerance 5e-3: a CPU's
  # summation order may move a rounded input to its neighbouring bfloat16 value, which
  # moved a log-prob by 2.2e-3 on a 2-core AMD EPYC (1e-3 held on an Intel Xeon).
  f32 = transformer.create(config.tiny(), seed=3)
  bf = twin(f32, matmul_dtype="bfloat16")
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, 64, (rows, 8)).astype(np.int32))
  lens = jnp.asarray(np.arange(rows, dtype=np.int32) % 7 + 1)
  cfg = SamplerConfig(group_size=group, max_new_tokens=new, eos_id=1, max_prompt_len=8)
  r = sample_groups(bf, prompts, lens, jax.random.key(0), cfg)
  teacher = nnx.jit(response_logprobs)
  lp_bf, _ = teacher(bf, prompts, lens, r.tokens_BxGxT)
  lp_32, _ = teacher(f32, prompts, lens, r.tokens_BxGxT)
  mask = np.asarray(r.mask_BxGxT)
  np.testing.assert_allclose(np.asarray(lp_bf) * mask, r.logp_BxGxT, rtol=0, atol=5e-3)
  gap = np.abs(np.asarray(lp_bf) - np.asarray(lp_32))[mask > 0]
  assert 0 < gap.max() < 0.05, gap.max()


@pytest.mark.parametrize("tied", [False, True])
def test_model_gradients_close_to_float32(tied):
  # tied: the unembedding is the table transposed; its weight gradient's dot once failed
  # to run on XLA:CPU (the transpose folded into the dot's output layout).
  f32 = transformer.create(config.tiny(tie_embeddings=tied), seed=5)
  bf = twin(f32, matmul_dtype="bfloat16")
  tokens = jnp.asarray(np.random.default_rng(1).integers(2, 64, (2, 9)).astype(np.int32))
  prompts, lens, resp = tokens[:, :4], jnp.array([4, 3], jnp.int32), tokens[:, None, 4:]

  def grads(m):
    graphdef, params = nnx.split(m)
    loss = lambda p: response_logprobs(nnx.merge(graphdef, p), prompts, lens, resp)[0].sum()
    return jax.jit(jax.grad(loss))(params)
  g32, gbf = jax.tree.leaves(grads(f32)), jax.tree.leaves(grads(bf))
  assert all(g.dtype == jnp.float32 for g in gbf)
  num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(g32, gbf)) ** 0.5
  den = sum(float(jnp.sum(a ** 2)) for a in g32) ** 0.5
  assert 0 < num / den < 0.05, num / den


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_recomputes_the_same_bf16_gradients(remat):
  f32 = transformer.create(config.tiny(), seed=7)
  plain, recomputed = twin(f32, matmul_dtype="bfloat16"), twin(f32, matmul_dtype="bfloat16",
                                                                remat=remat)
  tokens = jnp.asarray(np.random.default_rng(2).integers(2, 64, (2, 8)).astype(np.int32))
  prompts, lens, resp = tokens[:, :3], jnp.array([3, 2], jnp.int32), tokens[:, None, 3:]

  def grads(m):
    graphdef, params = nnx.split(m)
    loss = lambda p: response_logprobs(nnx.merge(graphdef, p), prompts, lens, resp)[0].sum()
    return jax.tree.leaves(jax.jit(jax.grad(loss))(params))
  # A recomputed forward may sum in another order; an input that then rounds to the
  # neighbouring bfloat16 moves its products by up to 2^-8 relative. The gradients must
  # agree far inside that (a wrong recomputation is off by O(1)).
  a, b = grads(plain), grads(recomputed)
  num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(a, b)) ** 0.5
  den = sum(float(jnp.sum(x ** 2)) for x in a) ** 0.5
  assert num / den < 1e-3, num / den
