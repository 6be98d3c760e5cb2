"""The TPU planner (gspo_jax/plan/planner.py): the run's own programs compiled for a Cloud TPU
topology on this CPU machine (libtpu, no TPU), per-chip parameter bytes that follow the
mesh, a plan that cannot fit reported per program, and bad topologies, meshes and a missing
libtpu refused by name before anything is compiled."""

import importlib.util

import jax
import numpy as np
import pytest

from gspo_jax.config import TrainConfig
from gspo_jax.plan import hlo as plan_hlo
from gspo_jax.plan import planner as plan
from gspo_jax.utils import configlib

SMOKE = "configs/addition_tiny.py:smoke"


@pytest.fixture(scope="module")
def libtpu():
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("compiling for TPU topologies needs the optional libtpu "
                "(pip install -r requirements-plan.txt); CI installs it")


def smoke(*sets: str) -> TrainConfig:
  return configlib.apply_overrides(configlib.load_config(SMOKE), list(sets))


def test_every_program_of_the_smoke_run_compiles_for_v5e_2x2_and_fits(libtpu):
  report = plan.plan(smoke("mesh.data=1", "mesh.fsdp=4"), "v5e:2x2")
  assert report["chips"] == 4 and report["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}
  assert set(report["programs"]) == {"init", "sample", "greedy", "sft", "prepare", "update"}
  assert report["fits"] and all(p["fits"] for p in report["programs"].values())
  # The parameters split 4 ways by fsdp: their bytes / (fsdp * tensor) per chip, but for
  # the per-head q/k norms (logical axis head_dim, which no mesh axis splits): 2 per layer.
  # init's argument is the parameters as the chip lays them out (its tiles pad small
  # arrays: at least the shard's bytes).
  from flax import nnx

  from gspo_jax.models.transformer import Transformer
  cfg = smoke()
  params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))),
                     nnx.Param)
  total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
  qk_norms = cfg.model.num_layers * 2 * cfg.model.head_dim * 4
  assert report["param_bytes"] == total
  assert report["param_bytes_per_chip"] == (total - qk_norms) // 4 + qk_norms
  assert report["programs"]["init"]["argument"] >= total // 4
  replicated = plan.plan(smoke(), "v5e:2x2")   # data=4: every chip holds all of them
  assert replicated["param_bytes_per_chip"] == total
  assert replicated["programs"]["init"]["argument"] > report["programs"]["init"]["argument"]
  # The update donates the state: what it returns in place of its arguments is aliased.
  update = report["programs"]["update"]
  assert update["alias"] > 0 and update["peak"] < update["argument"] + update["output"] + \
      update["temp"] + update["code"]
  text = plan.format_report(report)
  assert "verdict: every program fits" in text and "update" in text


def test_a_plan_that_cannot_fit_is_reported_per_program_and_exits_1(libtpu, capsys):
  # 2 layers of hidden 16,384 and MLP 65,536, replicated over data=4: ~25 GiB of float32
  # parameters per 16 GiB v5e chip.
  big = ["--set", "model.hidden=16384", "--set", "model.mlp_dim=65536",
         "--set", "model.num_heads=64", "--set", "model.num_kv_heads=8",
         "--set", "model.head_dim=128"]
  with pytest.raises(SystemExit) as e:
    plan.main(["--config", SMOKE, "--topology", "v5e:2x2", *big])
  assert e.value.code == 1
  out = capsys.readouterr().out
  assert "init     does not fit: RESOURCE_EXHAUSTED" in out
  assert "verdict: does not fit (init, sample, prepare, update, greedy, sft over 16 GiB" in out


@pytest.mark.parametrize("topology,sets,match", [
    ("v9:2x2", [], r"--topology 'v9:2x2' is not a TPU topology GEN:AxB\[xC\] .* known here: "
                   r"v5e:2x2"),
    ("v5e:3x3", [], r"--topology 'v5e:3x3' is not a topology libtpu knows"),
    ("v5e:2x2", ["mesh.data=3"], r"mesh.data \* mesh.fsdp \* mesh.expert \* mesh.tensor = 3 must equal the "
                                 r"number of devices \(4\).*\(4 chips in v5e:2x2\)"),
    ("v5e:2x2", ["mesh.data=1", "mesh.tensor=4"], r"model.num_kv_heads = 1 is not divisible "
                                                  r"by mesh axis mesh.tensor=4"),
    ("v5e:2x2", ["rollout.prompts_per_iter=6"], r"rollout.prompts_per_iter = 6 is not "
                                                r"divisible by the batch mesh axes"),
])
def test_bad_plans_are_refused_by_name_before_compiling(libtpu, topology, sets, match):
  with pytest.raises(plan.PlanError, match=match):
    plan.plan(smoke(*sets), topology)


def test_a_missing_libtpu_names_the_pip_command(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(plan.PlanError, match=r"needs libtpu \(no TPU needed\): pip install "
                                           r"'libtpu==0\.0\.42\.1'"):
    plan.topology_devices("v5e:2x2")
  with pytest.raises(SystemExit, match="plan error: .*pip install"):
    plan.main(["--config", SMOKE, "--topology", "v5e:2x2"])


def test_collective_traffic_is_weighted_by_loop_trip_counts(libtpu):
  """A loop of n steps, each reducing a row-sharded (1024, 256) float32 array over its rows
  (one all-reduce of a (1, 256) float32 result, 1,024 bytes): n x 1,024 bytes, linear in n,
  though the HLO holds the all-reduce once."""
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = Mesh(np.array(plan.topology_devices("v5e:2x2")), ("x",))

  def hlo(n):
    def loop(a):
      body = lambda i, c: c + jnp.sum(a * c, axis=0, keepdims=True)
      return jax.lax.fori_loop(0, n, body, jnp.ones((1, 256)))
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    return jax.jit(loop, out_shardings=NamedSharding(mesh, P())).lower(x).compile().as_text()

  for n in (3, 6):
    text = hlo(n)
    assert plan_hlo.static_counts(text)["all-reduce"] == 1
    moved = plan_hlo.collective_bytes(text)
    assert moved["all-reduce"] == n * 1024 and moved["dynamic_loops"] == 0


def test_a_pretrained_run_is_planned_with_the_model_setup_would_load():
  """`pretrained`: the architecture from its config.json (this fixture stores float32), the
  parameter dtype `pretrained_dtype` and how it runs the user's `model.remat`, as
  `run.setup` loads it (no weight is read)."""
  import dataclasses

  from gspo_jax.models import hf
  fixture = "tests/data/hf_fixtures/qwen3_tied"
  stored = hf.config_from_hf(hf.read_config(fixture))
  cfg = TrainConfig(pretrained=fixture, pretrained_dtype="bfloat16",
                    model=dataclasses.replace(TrainConfig().model, remat="full"))
  planned = plan._model_cfg(cfg)
  assert (planned.hidden, planned.num_layers) == (stored.hidden, stored.num_layers)
  assert planned.param_dtype == "bfloat16" and planned.remat == "full"
  assert plan._model_cfg(TrainConfig(pretrained=fixture)).param_dtype == "float32"


def test_analytic_flops_match_xla_count_of_an_unrolled_forward():
  """`plan_cost.teacher_forcing_flops` (the count behind the roofline) against XLA's own
  count of the same teacher-forced pass, which is exact here: unrolled layers and one
  log-prob chunk leave no loop for `cost_analysis` to count once. XLA also counts the
  elementwise work (norms, softmax, RoPE), so it may only be a little larger."""
  import jax.numpy as jnp
  from flax import nnx

  from gspo_jax.models.config import tiny
  from gspo_jax.models.transformer import Transformer
  from gspo_jax.plan import cost as plan_cost
  from gspo_jax.rollout.teacher_forcing import response_logprobs
  m = tiny(vocab_size=512, hidden=256, mlp_dim=1024, num_heads=4, num_kv_heads=2,
           head_dim=64, num_layers=2)
  B, G, P, T = 2, 4, 16, 32
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0))))

  def forward(state, prompts, lens, tokens):
    return response_logprobs(nnx.merge(graphdef, state), prompts, lens, tokens,
                             share_prompts=True)[0]

  S = jax.ShapeDtypeStruct
  compiled = jax.jit(forward).lower(state, S((B, P), jnp.int32), S((B,), jnp.int32),
                                    S((B, G, T), jnp.int32)).compile()
  xla = compiled.cost_analysis()["flops"]
  ours = plan_cost.teacher_forcing_flops(m, B, G, P, T, share_prompts=True)
  assert ours <= xla <= 1.1 * ours, (ours, xla)


def test_interconnect_bytes_per_chip_follow_ring_algorithms():
  from gspo_jax.plan import cost as plan_cost
  assert plan_cost.group_size("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, x", 8) == 4
  assert plan_cost.group_size("replica_groups=mesh['a'=2,'b'=4] {'a','b'}, x", 8) == 8
  assert plan_cost.group_size("replica_groups=[2,4]<=[8], x", 8) == 4
  assert plan_cost.group_size("replica_groups={{0,1},{2,3}}, x", 4) == 2
  assert plan_cost.group_size("source_target_pairs={{0,1}}", 16) == 16
  S = 1024
  assert plan_cost.wire_bytes("all-reduce", S, 4) == 2 * S * 3 / 4
  assert plan_cost.wire_bytes("all-gather", S, 4) == S * 3 / 4
  assert plan_cost.wire_bytes("reduce-scatter", S // 4, 4) == S * 3 / 4   # the same S moved
  assert plan_cost.wire_bytes("all-reduce", S, 1) == 0
  chip = plan_cost.CHIPS["v5e"]
  r = plan_cost.roofline(4 * 197e12, 819e9 / 2, 200e9 * 3, chip, devices=4)
  assert (r["compute_s"], r["hbm_s"], r["ici_s"]) == (1.0, 0.5, 3.0) and r["bound"] == "ici"


def test_a_reduce_scatter_written_as_an_all_reduce_fusion_counts_its_shard():
  """TPU compiles a reduce-scatter as a fusion named all-reduce-scatter around an
  all-reduce of the full array: counted as a reduce-scatter, its result one chip's 1/n."""
  hlo = ("%all-reduce-scatter.1 (p: f32[1024]) -> f32[256] {\n"
         "  %ar = f32[1024]{0} all-reduce(%p), channel_id=7, replica_groups={{0,1,2,3}}, "
         "to_apply=%add\n  ROOT %s = f32[256]{0} slice(%ar)\n}\n\n"
         "ENTRY %main (x: f32[1024]) -> f32[256] {\n"
         "  ROOT %f = f32[256]{0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.1\n}\n")
  moved = plan_hlo.collective_bytes(hlo, devices=4)
  assert moved["reduce-scatter"] == 1024 and moved["all-reduce"] == 0
  assert moved["wire"] == 4096 * 3 / 4


def test_search_lists_the_meshes_that_fit_and_names_the_smallest_shortfall(libtpu):
  assert plan.mesh_choices(4) == [(1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2),
                                  (1, 1, 4)]
  found = plan.search(smoke(), "v5e:2x2", only=("init",))
  assert [e["mesh"] for e in found["fits"]] == ["data=1 fsdp=4 tensor=1",
                                                "data=2 fsdp=2 tensor=1",
                                                "data=4 fsdp=1 tensor=1"]
  with_remat = plan.search(smoke(), "v5e:2x2", only=("init",), remats=("full", "none"))
  assert sorted(e["mesh"] for e in with_remat["fits"])[:2] == [
      "data=1 fsdp=4 tensor=1 remat=full", "data=1 fsdp=4 tensor=1 remat=none"]
  assert len(with_remat["fits"]) == 6
  # The smoke model has one kv head: no tensor axis divides it (refused by name).
  assert len(found["refused"]) == 3 and all("model.num_kv_heads" in r["why"]
                                            for r in found["refused"])
  big = smoke("model.hidden=16384", "model.mlp_dim=65536", "model.num_heads=64",
              "model.num_kv_heads=8", "model.head_dim=128", "model.num_layers=4")
  with pytest.raises(plan.PlanError, match=r"no mesh of v5e:2x2's 4 chips fits this config "
                                           r".*the smallest shortfall: .* GiB per chip over "
                                           r"the HBM with data=1 fsdp=2 tensor=2"):
    plan.search(big, "v5e:2x2", only=("init",))


def test_the_local_devices_are_planned_like_a_topology():
  """`--topology local` (for a lent accelerator): the same programs on this process's 8
  simulated CPU devices; the CPU's HBM and peaks are unknown, so no verdict against a
  capacity and no roofline, but memory and traffic as for a TPU."""
  report = plan.plan(smoke("mesh.data=2", "mesh.fsdp=4"), "local", only=("update",))
  assert report["chips"] == 8 and report["mesh"] == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
  update = report["programs"]["update"]
  assert update["fits"] and update["peak"] > 0 and "time_s" not in update
  assert update["flops"] > 0 and "iteration_s" not in report
  assert "unknown HBM per chip" in plan.format_report(report)


def test_an_expert_parallel_moe_update_compiles_for_tpu_without_activation_all_reduces(libtpu):
  """A tiny MoE's update on v5e:2x2: with the experts split by their width over fsdp the
  routed tokens' expert activations (f32[tokens, moe_mlp]) are all-reduced; with
  mesh.expert=2 they are not, tokens travel by all-gather / reduce-scatter instead, and the
  update sends several times fewer all-reduce bytes."""
  import re
  moe = ("model.num_experts=8", "model.experts_per_token=2", "model.moe_mlp_dim=64",
         "model.moe_dispatch=ragged", "mesh.data=1")
  before = plan.plan(smoke(*moe, "mesh.fsdp=4"), "v5e:2x2", only=("update",))
  after = plan.plan(smoke(*moe, "mesh.fsdp=2", "mesh.expert=2"), "v5e:2x2", only=("update",))
  assert after["mesh"]["expert"] == 2 and after["fits"]
  rows = lambda r: {int(n) for op in r["programs"]["update"]["collective_bytes"]["largest"]
                    if op["kind"] == "all-reduce" for n in re.findall(r"f32\[(\d+),64\]", op["shape"])}
  assert rows(before), before["programs"]["update"]["collective_bytes"]["largest"]
  assert not rows(before) & rows(after)
  b, a = (r["programs"]["update"]["collective_bytes"] for r in (before, after))
  assert a["reduce-scatter"] > 0 and a["all-reduce"] * 4 < b["all-reduce"]
