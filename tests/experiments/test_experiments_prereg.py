"""The settings experiments/preregistered.md's runs need, each in a quick mode: the MoE depth
sweep at about equal active parameters per token, config overrides for every run, and GSPO
with its clip range scaled to the response length."""

import json
import math
import os

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
  # The cold start's printed progress is kept beside its run, for the results to commit.
  assert "cold start step" in (tmp_path / "runs" / "coldstart_seed0.log").read_text()
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


def _fake_run(path, *, end: float, reward: float, start: float = 0.3, late=None,
              layers: int = 16, iterations: int = 40):
  """A finished run's committed files: held-out every 5 iterations (`late` for the second
  half's evaluations, default `end`), constant reward."""
  path.mkdir(parents=True)
  rows = []
  for step in range(1, iterations + 1):
    row = {"step": step, "reward_mean": reward, "routing_changed": 0.1, "approx_kl": 1e-4,
           "ratio_min": 0.9, "ratio_max": 1.1, "clip_frac_token": 0.01, "clip_frac_seq": 0.1}
    if step % 5 == 0:
      row["heldout_accuracy"] = end if step == iterations else (late if late is not None
                                                                and step > iterations / 2
                                                                else end)
    rows.append(row)
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (path / "summary.json").write_text(json.dumps({"heldout_accuracy_start": start,
                                                 "heldout_accuracy_end": end}))
  (path / "config.json").write_text(json.dumps({"model": {"num_layers": layers},
                                                "routing": "free", "loss": {"name": "grpo"}}))


def test_stage_b_analysis_by_hand(tmp_path):
  from experiments import routing_replay_depth as depth
  # Holm over (0.01, 0.04, 0.03): sorted 0.01*3, 0.03*2, 0.04*1 -> 0.03, 0.06, 0.06 (monotone).
  assert depth.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
  ends = {"grpo_free": [0.20, 0.25, 0.30, 0.35], "grpo_replay": [0.30, 0.36, 0.39, 0.47],
          "gspo_free": [0.40, 0.45, 0.50, 0.55]}
  for v, vals in ends.items():
    for s, e in enumerate(vals):
      # GRPO free collapses on seeds 0 and 1: every late evaluation below the cold start.
      _fake_run(tmp_path / f"{v}_seed{s}", end=e, reward=e / 2,
                late=0.1 if (v == "grpo_free" and s < 2) else None)
  # Not every registered run has finished: no outcome is read.
  (tmp_path / "gspo_free_seed3" / "summary.json").rename(tmp_path / "held.json")
  with pytest.raises(SystemExit, match="gspo_free_seed3"):
    depth.analyse(str(tmp_path))
  (tmp_path / "held.json").rename(tmp_path / "gspo_free_seed3" / "summary.json")
  r = depth.analyse(str(tmp_path))
  # (i) replay - free: diffs 0.10, 0.11, 0.09, 0.12 -> mean 0.105, sd 0.012910,
  # half-width 3.1824 * 0.012910 / 2 = 0.020542.
  b1 = r["B1_heldout_end"][0]
  assert (b1["a"], b1["b"]) == ("grpo_replay", "grpo_free")
  assert b1["mean"] == pytest.approx(0.105) and b1["half_width"] == pytest.approx(0.020542, abs=1e-6)
  assert r["B1_replay_needed_reproduced"]
  # (ii) GSPO free - GRPO free is 0.20 on every seed (up to float rounding): p ~ 0, and
  # Holm triples the smallest p.
  b1 = r["B1_heldout_end"][1]
  assert b1["mean"] == pytest.approx(0.2) and b1["p_holm"] == pytest.approx(3 * b1["p"])
  assert b1["p"] < 1e-6
  assert r["B3_reward_mean"][0]["mean"] == pytest.approx(0.0525)
  # B2: 2 of 4 against 0 of 4, Fisher two-sided p = 0.4286.
  assert r["B2_collapses"]["collapsed"] == {"grpo_free": 2, "grpo_replay": 0, "gspo_free": 0}
  assert r["B2_collapses"]["fisher_p"]["gspo_free"] == pytest.approx(0.428571, abs=1e-6)
  assert r["deviations"] == []
  assert r["runs"]["gspo_free"]["ratio_min_extreme"] == [0.9] * 4


def test_stage_b_tables_render_the_analysis(tmp_path):
  """experiments/_readme_replay_depth.py renders stage_b.json's numbers: the per-seed
  table, B1/B3 with Holm's p and the verdict by the interval, B2's counts, and the paired
  figure's series."""
  from experiments import _readme_replay_depth as t
  from experiments import routing_replay_depth as depth
  # Cold starts at 0.15; GRPO free's seed 0 falls to 0.10 and stays there (a collapse).
  ends = {"grpo_free": [0.10, 0.25, 0.30, 0.35], "grpo_replay": [0.30, 0.36, 0.39, 0.47],
          "gspo_free": [0.21, 0.24, 0.33, 0.34]}
  for v, vals in ends.items():
    for s, e in enumerate(vals):
      _fake_run(tmp_path / f"{v}_seed{s}", end=e, reward=e / 2, start=0.15,
                late=0.1 if (v == "grpo_free" and s == 0) else None)
  d = json.loads(json.dumps(depth.analyse(str(tmp_path))))  # as stage_b.json holds it
  seed_table = t.routing_replay_depth(d).splitlines()
  assert len(seed_table) == 2 + 4
  assert seed_table[2].startswith("| 0 | 0.150 | 0.100 / 0.300 / 0.210 | 0.050 / 0.150 / 0.105 "
                                  "| yes / no / no |")
  rows = t.routing_replay_depth_endpoints(d).splitlines()[2:]
  assert len(rows) == 3 + 3 + 2
  # (i): diffs +0.200 +0.110 +0.090 +0.120, mean 0.130, sd 0.0483, half-width 0.0769.
  assert "| B1 | held-out after 40 | GRPO replay − GRPO free | 4 | +0.200 / +0.110 / +0.090 / " \
         "+0.120 | +0.130 |" in rows[0]
  assert "| [+0.053, +0.207] |" in rows[0]
  assert "(Holm " in rows[0] and "GRPO replay above GRPO free" in rows[0]
  # (ii) GSPO free - GRPO free: +0.110 / -0.010 / +0.030 / -0.010, interval across zero.
  assert "no difference resolved" in rows[1] and "(Holm" in rows[1]
  assert "(Holm" not in rows[3] and rows[3].startswith("| B3 |")
  assert "| 1 of 4 vs 0 of 4 |" in rows[6] and "| 1 |" in rows[6]  # Fisher p = 1
  figure = t.figure_comparisons(d)
  assert [f[0] for f in figure][:1] == ["B1: GRPO replay − GRPO free"] and len(figure) == 6
  assert figure[0][1] == ends["grpo_replay"]
  assert t.routing_replay_depth_descriptive(d).count("\n") == 4


def test_stage_c_seeds_follow_the_cold_start_logs(tmp_path):
  """Stage C's analysis set: the first 4 seeds whose cold-start log says it reached its
  target; refused while a seed before the set is complete has not run."""
  from experiments import routing_replay_depth as depth
  for seed, ok in enumerate([True, False, True, True]):
    (tmp_path / f"coldstart_seed{seed}.log").write_text(
        "cold start step    5/600: loss 1.0, train-probe accuracy 0.1\n" +
        ("cold start reached the target accuracy 0.3 at step 5\n" if ok else ""))
  with pytest.raises(SystemExit, match="run seed 4 next"):
    depth.stage_c_seeds(str(tmp_path))
  (tmp_path / "coldstart_seed4.log").write_text("cold start reached the target accuracy 0.3\n")
  assert depth.stage_c_seeds(str(tmp_path)) == [0, 2, 3, 4]
  assert depth.stage_c_seeds(str(tmp_path), size=4, most=4) == [0, 2, 3]


def test_processes_sharing_a_cold_start_take_turns(tmp_path, monkeypatch):
  """Two runners of one experiment directory (the README runs halves side by side) make a
  seed's cold start once: the second waits for the first instead of removing its
  half-written checkpoint (which crashed a side-by-side run)."""
  import threading
  import time

  from experiments import _runs
  calls, errors = [], []

  def fake_train(cfg, run_dir, **kw):
    calls.append(run_dir)
    os.makedirs(os.path.join(run_dir, "checkpoints"))
    time.sleep(0.3)

  def runner():
    try:
      _runs.cold_start(str(tmp_path), 0, cfg)
    except Exception as e:  # a thread's exception would not reach the test
      errors.append(e)

  monkeypatch.setattr(_runs.train, "train", fake_train)
  cfg = _runs.base_config("addition", quick=True)
  threads = [threading.Thread(target=runner) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == [] and len(calls) == 1
  assert (tmp_path / "runs" / "coldstart_seed0" / "done").exists()
