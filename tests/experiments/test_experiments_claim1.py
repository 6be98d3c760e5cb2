"""Claim 1 with power (experiments/preregistered.md, part 5): the analysis-set rule, the
verdict wording, the secondary endpoints and the compact record, on made-up numbers with
known answers (experiments/_readme_claim1.py, experiments/claim1_powered.py)."""

import json
import math

import pytest

from experiments import _readme_claim1 as c1
from experiments import _stats, claim1_powered


def test_analysis_set_is_the_first_eight_in_the_band():
  cold = {0: 0.30, 1: 0.50, 2: 0.25, 3: 0.45, 4: 0.2499, 5: 0.33, 6: 0.40, 7: 0.41,
          8: 0.42, 9: 0.43, 10: 0.44}
  s = c1.analysis_set(cold)
  # 1 and 4 are out of the band (0.45 and 0.25 are in it); the first 8 in seed order.
  assert s["seeds"] == [0, 2, 3, 5, 6, 7, 8, 9] and s["beyond"] == [10]
  assert s["out_of_band"] == [1, 4] and not s["short"]
  assert c1.analysis_set({str(k): v for k, v in cold.items()})["seeds"] == s["seeds"]


def test_fewer_than_six_in_the_band_is_short():
  cold = {k: (0.3 if k < 5 else 0.6) for k in range(10)}
  s = c1.analysis_set(cold)
  assert s["seeds"] == [0, 1, 2, 3, 4] and s["short"]
  assert not c1.analysis_set({k: 0.3 for k in range(6)})["short"]


def _paired(diffs):
  return _stats.paired(diffs, [0.0] * len(diffs))


def test_verdict_wording_by_the_interval():
  # Mean 0.05, sd 0.01 over 8 seeds: the interval lies above zero.
  above = _paired([0.04, 0.06] * 4)
  assert c1.verdict(above, "GSPO", "GRPO") == "GSPO above GRPO"
  assert c1.verdict(_paired([-0.04, -0.06] * 4), "GSPO", "GRPO") == "GRPO above GSPO"
  # Mean 0, sd 0.02: half-width 2.365 * 0.02 / sqrt(8) ~ 0.018: no difference resolved.
  small = _paired([0.02, -0.02] * 4)
  hw = 2.3646 * _stats.sample_std([0.02, -0.02] * 4) / math.sqrt(8)
  assert small["half_width"] == pytest.approx(hw, rel=1e-4)
  assert c1.verdict(small, "GSPO", "GRPO") == f"no difference resolved (±{_stats.rnd(hw, 3)})"
  # sd 0.1: half-width ~0.09 > 0.05: not resolved at this precision, not "no difference".
  wide = _paired([0.1, -0.1] * 4)
  assert c1.verdict(wide, "GSPO", "GRPO").startswith("not resolved at this precision (±0.0")
  # A resolved interval wider than 0.05 still names its side.
  assert c1.verdict(_paired([0.3, 0.1] * 4), "GSPO", "GRPO") == "GSPO above GRPO"


def test_mean_gain_and_collapse_on_a_curve():
  curve = [[0, 0.3]] + [[s, 0.3 + 0.01 * s / 5] for s in range(5, 41, 5)]
  assert c1.mean_gain(curve) == pytest.approx(0.045)  # mean of 0.01..0.08
  assert not c1.collapsed(curve, 40)
  # Below the start at 25, 30, 35, 40 (the second half), above it at 20: collapsed.
  down = [[0, 0.3], [5, 0.4], [10, 0.4], [15, 0.4], [20, 0.5], [25, 0.29], [30, 0.1],
          [35, 0.2], [40, 0.29]]
  assert c1.collapsed(down, 40)
  down[-1][1] = 0.3  # equal to the start is not below it
  assert not c1.collapsed(down, 40)


def _fake_runs(root, ends):
  """A runs/ folder like gspo_vs_grpo.py's: ends[variant][seed] = held-out after 40."""
  setting = {"task": {"steps": 6}, "rollout": {"max_new_tokens": 72, "prompts_per_iter": 32,
                                               "group_size": 8},
             "num_minibatches": 8, "optim": {"learning_rate": 1e-4}, "iterations": 40,
             "eval_every": 5, "eval_size": 512,
             "sft": {"check_every": 5, "probe_size": 256, "target_accuracy": 0.3}}
  for variant, seeds in ends.items():
    for seed, end in seeds.items():
      d = root / "runs" / f"{variant}_seed{seed}"
      d.mkdir(parents=True)
      start = 0.3 + 0.01 * seed
      lo, hi = claim1_powered.EPS[variant]
      cfg = dict(setting, loss={"name": "gspo" if variant == "gspo_len" else variant,
                                "eps_low": lo, "eps_high": hi})
      (d / "config.json").write_text(json.dumps(cfg))
      rows = []
      for step in range(1, 41):
        row = {"step": step, "reward_mean": step / 100, "clip_frac_token": 0.1,
               "clip_frac_seq": 0.2, "response_length": 60, "time_iteration": 2.0}
        if step % 5 == 0:
          row["heldout_accuracy"] = start + (end - start) * step / 40
        rows.append(row)
      (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
      (d / "summary.json").write_text(json.dumps(
          {"heldout_accuracy_start": start, "heldout_accuracy_end": rows[-1]["heldout_accuracy"]}))
      (d / "provenance.json").write_text(json.dumps(
          {"commit": "abc", "dirty": False, "command": "python -m x", "machine": "cpu",
           "load_average_before": [1.0, 1, 1], "load_average_after": [2.0, 2, 2],
           "seconds": 60.0}))


def test_compact_record_and_the_registered_comparisons(tmp_path):
  seeds = range(10)
  ends = {"gspo": {s: 0.5 for s in seeds}, "grpo": {s: 0.45 + 0.002 * s for s in seeds},
          "gspo_len": {s: 0.2 for s in seeds if s != 3}}  # one run missing
  _fake_runs(tmp_path, ends)
  d = claim1_powered.compact(str(tmp_path))
  assert d["missing"] == ["gspo_len_seed3"] and d["deviations"] == []
  g = d["variants"]["gspo"]
  assert g["seeds"] == list(seeds) and g["iterations"] == [40] * 10
  assert g["reward_last10"][0] == pytest.approx(0.355)  # mean of 0.31..0.40
  assert g["heldout_curve"][0][0] == [0, 0.3] and len(g["heldout_curve"][0]) == 9
  assert d["variants"]["gspo_len"]["collapsed"] == [True] * 9
  assert d["provenance"]["load_1min_range"] == [1.0, 2.0]
  # Every cold start 0.30..0.39: in the band, so the set is seeds 0..7.
  assert c1.analysis_set(d["coldstart_heldout"])["seeds"] == list(range(8))
  cmp = {(c["endpoint"], c["key"], c["a"], c["b"]): c for c in c1.comparisons(d)}
  p1 = cmp[("P1", "end", "gspo", "grpo")]
  assert p1["seeds"] == list(range(8))
  assert p1["paired"]["mean"] == pytest.approx(0.05 - 0.002 * 3.5)
  assert p1["verdict"] == "GSPO above GRPO"
  p2 = cmp[("P2", "end", "gspo_len", "gspo")]
  assert p2["seeds"] == [0, 1, 2, 4, 5, 6, 7] and p2["verdict"] == "GSPO above GSPO-len"
  # The gain over evaluations is linear in the step here: its mean is (end − start) * 22.5/40.
  gain = cmp[("secondary", "gain", "gspo", "grpo")]["paired"]
  assert gain["mean"] == pytest.approx((0.05 - 0.002 * 3.5) * 22.5 / 40)
  assert cmp[("secondary", "reward", "gspo", "grpo")]["paired"]["mean"] == pytest.approx(0)
  f = {(x["a"], x["b"]): x for x in c1.fisher(d)}
  assert f[("gspo_len", "gspo")]["a_count"] == (7, 7) and f[("gspo_len", "gspo")]["b_count"] == (0, 8)
  assert f[("gspo_len", "gspo")]["p"] == pytest.approx(_stats.fisher_exact(7, 7, 0, 8))
  # The stored collapse flag is the rule applied to the stored curve.
  for v in d["variants"].values():
    for curve, flag in zip(v["heldout_curve"], v["collapsed"]):
      assert c1.collapsed(curve, 40) == flag


def test_a_departure_from_the_registration_is_reported(tmp_path):
  _fake_runs(tmp_path, {"gspo": {0: 0.5}})
  cfg_path = tmp_path / "runs" / "gspo_seed0" / "config.json"
  cfg = json.loads(cfg_path.read_text())
  cfg["num_minibatches"] = 4
  cfg_path.write_text(json.dumps(cfg))
  d = claim1_powered.compact(str(tmp_path), variants=("gspo",), seeds=(0,))
  assert d["deviations"] == ["gspo seed 0: num_minibatches = 4, registered 8"]


def test_tables_and_figure_render_from_a_made_up_record(tmp_path, monkeypatch):
  from experiments import _plots
  seeds = range(10)
  _fake_runs(tmp_path, {"gspo": {s: 0.5 for s in seeds}, "grpo": {s: 0.4 for s in seeds},
                        "gspo_len": {s: 0.45 + 0.01 * (s % 3) for s in seeds}})
  d = claim1_powered.compact(str(tmp_path))
  monkeypatch.setattr(c1, "load", lambda: d)
  seed_table = c1.claim1_powered()
  assert seed_table.count("\n") == 11 and "| 8 | 0.380 | no: in the band, after the first 8 |" in seed_table
  assert "| 0 | 0.300 | yes | 0.500 | 0.400 | 0.450 | +0.100 | +0.050 | −0.050 | no / no / no |" in seed_table
  endpoints = c1.claim1_powered_endpoints()
  assert "| P1 | held-out accuracy after 40 iterations | GSPO − GRPO | 8 |" in endpoints
  assert "GSPO above GRPO; the paper predicts GSPO above GRPO" in endpoints
  assert "Fisher exact p = 1 (two-sided)" in endpoints
  assert c1.claim1_powered_secondary().count("\n") == 11
  path = _plots.paired(c1.figure_comparisons(), str(tmp_path), "paired.png")
  assert (tmp_path / "paired.png").stat().st_size > 0 and path.endswith("paired.png")


def test_committed_record_agrees_with_the_experiment_summary():
  """part5.json (claim1_powered.py) and summary.json (gspo_vs_grpo.py) hold the same runs:
  the same seeds, cold starts, final and per-evaluation held-out accuracies; every run
  finished, as registered, and its collapse flag is the rule on its curve."""
  from experiments._tables import load
  d, s = c1.load(), load(c1.NAME)
  assert d["missing"] == [] and d["deviations"] == []
  for v in c1.VARIANTS:
    for key in ("seeds", "heldout_start", "heldout_end", "heldout_curve"):
      assert d["variants"][v][key] == s[v][key], (v, key)
    for curve, flag in zip(d["variants"][v]["heldout_curve"], d["variants"][v]["collapsed"]):
      assert c1.collapsed(curve, 40) == flag
  assert len(c1.analysis_set(d["coldstart_heldout"])["seeds"]) == c1.SET_SIZE
