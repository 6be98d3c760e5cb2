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
