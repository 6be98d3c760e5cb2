"""Each experiment's --quick mode runs end to end (so the scripts do not rot): outputs exist,
numbers are finite, and the exact identity of experiment 5 holds."""

import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def finite(tree):
  if isinstance(tree, dict):
    return all(finite(v) for v in tree.values())
  if isinstance(tree, list):
    return all(finite(v) for v in tree)
  return tree is None or isinstance(tree, str) or math.isfinite(tree)


@pytest.mark.slow
def test_gspo_vs_grpo_quick(tmp_path):
  summary = load("gspo_vs_grpo").main(["--quick", "--seeds", "0", "--iterations", "2",
                                       "--out", str(tmp_path)])
  assert set(summary) >= {"gspo", "grpo", "clip_ratio_gspo_over_grpo"} and finite(summary)
  for name in ("summary.json", "reward.png", "heldout.png", "reward_vs_time.png",
               "clip_fraction.png"):
    assert (tmp_path / name).stat().st_size > 0, name
  assert summary["gspo"]["iterations"] == summary["grpo"]["iterations"] == 2
  # Training seconds come from the loop's own per-iteration wall time.
  assert all(s > 0 for loss in ("gspo", "grpo") for s in summary[loss]["train_seconds"])
  # Same seed, same deterministic cold start: both losses start from the same policy.
  assert summary["gspo"]["heldout_start"] == summary["grpo"]["heldout_start"]
  assert json.loads((tmp_path / "summary.json").read_text())["gspo"]["seeds"] == [0]
  # Experiment 4 on the quick GSPO run's policy.
  gap = load("precision_gap").main(["--quick", "--run", str(tmp_path / "runs" / "gspo_seed0"),
                                    "--out", str(tmp_path / "gap")])
  assert finite(gap) and gap["responses"] > 0 and (tmp_path / "gap" / "log_ratio_hist.png").exists()
  assert gap["tokens"] >= gap["responses"]


def test_gspo_token_equivalence_quick(tmp_path):
  summary = load("gspo_token_equivalence").main(["--quick", "--out", str(tmp_path)])
  assert finite(summary) and (tmp_path / "param_diff.png").stat().st_size > 0
  # Equal up to float rounding: bit for bit in the experiment's own (optimised) XLA build,
  # within 1% of one Adam step (lr 1e-3) under this suite's unoptimised XLA flags, where a
  # rounding difference on a near-zero gradient coordinate survives Adam's normalisation.
  # A token-level bonus moves parameters by about a whole step (2e-3) from step 1.
  assert max(summary["max_param_diff_vs_gspo"]["gspo_token"]) < 1e-5
  assert min(summary["max_param_diff_vs_gspo"]["gspo_token_bonus"]) > 1e-3
  assert summary["param_change_of_gspo"] > 1e-4


def test_moe_routing_quick(tmp_path):
  summary = load("moe_routing").main(["--quick", "--out", str(tmp_path)])
  assert set(summary) == {"gspo_lr0.0001", "grpo_lr0.0001"} and finite(summary)
  for result in summary.values():
    assert 0 <= result["changed_fraction"] <= 1 and len(result["changed_per_layer"]) == 2
  assert (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_routing_replay_quick(tmp_path):
  # Two of the three variants (gspo_free runs the same code path as grpo_free).
  summary = load("routing_replay").main(["--quick", "--seeds", "0", "--iterations", "2",
                                         "--variants", "grpo_free", "grpo_replay",
                                         "--out", str(tmp_path)])
  assert set(summary) == {"grpo_free", "grpo_replay"} and finite(summary)
  for name in ("reward.png", "routing_changed.png", "clip_fraction.png", "ratio_range.png"):
    assert (tmp_path / name).stat().st_size > 0, name
  # Free routing is tracked, replayed routing cannot change (and is not logged).
  assert 0 <= summary["grpo_free"]["routing_changed_mean"][0] <= 1
  assert summary["grpo_replay"]["routing_changed_mean"] == [None]


@pytest.mark.slow
def test_precision_training_quick(tmp_path):
  # The one variant whose code path experiment 1's test does not run: bf16 sampler as pi_old.
  summary = load("precision_training").main(["--quick", "--iterations", "2", "--variants",
                                             "gspo_sampler", "--out", str(tmp_path)])
  assert set(summary) == {"gspo_sampler"} and finite(summary)
  assert summary["gspo_sampler"]["iterations"] == 2
  assert (tmp_path / "clip_fraction.png").stat().st_size > 0
