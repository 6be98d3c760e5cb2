"""The settings experiments/preregistered.md's runs need, each in a quick mode: the MoE depth
sweep at about equal active parameters per token, config overrides for every run, and GSPO
with its clip range scaled to the response length."""

import json
import math

import pytest

from experiments import gspo_vs_grpo, moe_routing


def active_params_per_token(width: dict, layers: int) -> int:
  """Matmul weights a token passes through: attention (q, o; k, v) and the top-2 experts'
  SwiGLU plus the router, per layer (experiments/_runs.py iteration_flops's W)."""
  d, h, kv, hd, f = (width[k] for k in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                        "moe_mlp_dim"))
  return layers * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * f * 2 + d * 8)


def test_depths_keep_the_active_parameters():
  # 2 layers: 2 * (32768 + 16384 + 49152 + 1024) = 198,656.
  base = active_params_per_token(moe_routing.DEPTHS[2], 2)
  assert base == 198_656
  for layers, width in moe_routing.DEPTHS.items():
    assert width["num_heads"] % width["num_kv_heads"] == 0 and width["head_dim"] % 2 == 0
    assert abs(active_params_per_token(width, layers) / base - 1) < 0.07, layers


def test_length_scaled_eps_by_hand():
  # 0.2 / sqrt(63) = 0.025198, 0.27 / sqrt(63) = 0.034017; at 1 token GRPO's own range.
  assert gspo_vs_grpo.length_scaled_eps(63) == pytest.approx((0.025198, 0.034017), abs=1e-6)
  assert gspo_vs_grpo.length_scaled_eps(1) == (0.2, 0.27)


def test_gspo_len_needs_its_length():
  with pytest.raises(SystemExit):
    gspo_vs_grpo.config("gspo_len", 0, True, 1, "long", None)


def test_gspo_len_and_overrides_reach_the_run(tmp_path):
  gspo_vs_grpo.main(["--task", "long", "--quick", "--losses", "gspo_len", "--eps-tokens", "63",
                     "--seeds", "0", "--iterations", "1", "--out", str(tmp_path),
                     "--set", "task.steps=4", "num_minibatches=2"])
  cfg = json.loads((tmp_path / "runs" / "gspo_len_seed0" / "config.json").read_text())
  assert cfg["task"]["steps"] == 4 and cfg["num_minibatches"] == 2
  assert cfg["loss"]["name"] == "gspo"
  assert cfg["loss"]["eps_low"] == pytest.approx(0.2 / math.sqrt(63))


def test_moe_depth_sweep_quick(tmp_path):
  summary = moe_routing.main(["--quick", "--layers", "2", "4", "--minibatches", "2",
                              "--out", str(tmp_path)])
  assert set(summary) == {f"{loss}_lr0.0001_L{L}_mb2_seed0" for loss in ("gspo", "grpo")
                          for L in (2, 4)}
  for key, result in summary.items():
    layers = int(key.split("_L")[1].split("_")[0])
    assert len(result["changed_per_layer"]) == layers
    # A token whose experts changed in some layer: at least as many as in any one layer.
    assert max(result["changed_per_layer"]) <= result["changed_any_layer"] <= 1
    for side in ("flipped", "kept"):
      value = result[f"abs_log_ratio_mean_{side}"]
      assert value is None or value >= 0


def test_depth_endpoints_are_the_registered_slopes_and_intervals():
  """experiments/_readme_depth.endpoints on a made-up summary with known answers: A1 the
  slope of the any-layer change on log2(layers) per seed, A2 the slope of the per-layer
  change on the layer index in the deepest model, A3 log(median flipped / median kept);
  each a one-sample 95% t-interval over seeds."""
  import math

  from experiments import _readme_depth as d
  s = {}
  for seed, (a1, a2, ratio) in enumerate([(0.01, 0.002, 2.0), (0.03, 0.004, 4.0)]):
    for L in (2, 4, 8, 16):
      s[d.key("grpo", 1e-4, L, 16, seed)] = {
          "changed_any_layer": 0.1 + a1 * math.log2(L),
          "changed_per_layer": [0.05 + a2 * i for i in range(L)],
          "abs_log_ratio_median_flipped": ratio * 1e-3, "abs_log_ratio_median_kept": 1e-3}
  e = d.endpoints(s)
  assert e["depths"] == [2, 4, 8, 16] and e["deepest"] == 16
  for name, values in (("A1", [0.01, 0.03]), ("A2", [0.002, 0.004]),
                       ("A3", [math.log(2.0), math.log(4.0)])):
    assert e[name]["values"] == pytest.approx(values)
    mean, sd = sum(values) / 2, abs(values[1] - values[0]) / math.sqrt(2)
    assert e[name]["mean"] == pytest.approx(mean)
    assert e[name]["half_width"] == pytest.approx(12.706204736 * sd / math.sqrt(2), rel=1e-6)
  # The default key (2 layers, 4 minibatches, seed 0) carries no suffix, as moe_routing writes.
  assert d.key("gspo", 1e-4, 2, 4, 0) == "gspo_lr0.0001"
