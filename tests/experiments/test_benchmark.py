"""The benchmark script runs end to end at toy sizes (it measures; it asserts no speed)."""

import argparse
import json
import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_LOGPROBS = ["logprobs", "--batch", "2", "--tokens", "16", "--width", "8", "--vocab", "64",
                 "--chunk", "4", "--repeats", "1"]


def _git(*args) -> subprocess.CompletedProcess:
  return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)


def test_benchmark_logprobs_runs(tmp_path, monkeypatch, capsys):
  argv = ["benchmark.py", "--out", str(tmp_path), *TINY_LOGPROBS]
  monkeypatch.setattr(sys, "argv", argv)
  runpy.run_module("experiments.benchmark", run_name="__main__")
  record = json.load(open(tmp_path / "benchmark_logprobs.json"))
  result = record["result"]
  assert result["abs_diff_sum_logp"] < 1e-3
  assert result["plain"]["temp_bytes"] > 0 and result["lean"]["temp_bytes"] > 0
  assert "memory plain/lean" in capsys.readouterr().out


def test_benchmark_compile_runs(tmp_path, monkeypatch):
  argv = ["benchmark.py", "--out", str(tmp_path), "compile", "--layers", "2", "--modes", "scan",
          "--width", "16", "--heads", "2", "--kv-heads", "1", "--vocab", "32", "--rows", "2",
          "--prompt-len", "4", "--new-tokens", "2", "--programs", "update"]
  monkeypatch.setattr(sys, "argv", argv)
  runpy.run_module("experiments.benchmark", run_name="__main__")
  record = json.load(open(tmp_path / "benchmark_compile.json"))
  (row,) = record["result"]["rows"]
  assert row["mode"] == "scan" and row["layers"] == 2 and row["update_compile_seconds"] > 0
  assert record["result"]["model"]["scan_layers"] and len(record["load_average_before"]) == 3


def test_benchmark_bandwidth_runs(tmp_path, monkeypatch):
  argv = ["benchmark.py", "--out", str(tmp_path), "bandwidth", "--gib", "0.01", "--shape", "tiny",
          "--prompts", "2", "--group", "2", "--prompt-len", "4", "--new-tokens", "3",
          "--variants", "float32", "bf16_sampler", "--repeats", "1"]
  monkeypatch.setattr(sys, "argv", argv)
  runpy.run_module("experiments.benchmark", run_name="__main__")
  result = json.load(open(tmp_path / "benchmark_bandwidth.json"))["result"]
  assert result["bandwidth"]["read"]["bytes"] == 4 * (int(0.01 * 2**30) // 4)
  f32, bf16 = result["decode"]
  assert (f32["variant"], bf16["variant"]) == ("float32", "bf16_sampler")
  # The bfloat16 sampler reads half the weight bytes; the step's bytes are weights + cache.
  assert bf16["param_bytes"] * 2 == f32["param_bytes"]
  assert f32["step_bytes"] > f32["param_bytes"] and f32["seconds"] > 0


def test_benchmark_matmul_runs(tmp_path, monkeypatch):
  argv = ["benchmark.py", "--out", str(tmp_path), "matmul", "--shape", "tiny", "--prompts", "2",
          "--group", "2", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1"]
  monkeypatch.setattr(sys, "argv", argv)
  runpy.run_module("experiments.benchmark", run_name="__main__")
  (row,) = json.load(open(tmp_path / "benchmark_matmul.json"))["result"]["rows"]
  gap = row["logp_gap"]
  # bfloat16 inputs move the log-probs, but not far: the same weights, the same tokens.
  assert 0 < gap["token_mean_abs"] <= gap["token_max_abs"] < 0.5
  assert row["float32"]["seconds"] > 0 and row["bf16_matmul"]["seconds"] > 0


def test_benchmark_long_runs(tmp_path, monkeypatch):
  argv = ["benchmark.py", "--out", str(tmp_path), "long", "--new-tokens", "12", "--width", "16",
          "--vocab", "32", "--prompts", "2", "--group", "2", "--prompt-len", "4", "--rows", "2",
          "--remat", "none", "--attention-chunk", "0", "8", "--repeats", "1"]
  monkeypatch.setattr(sys, "argv", argv)
  runpy.run_module("experiments.benchmark", run_name="__main__")
  result = json.load(open(tmp_path / "benchmark_long.json"))["result"]
  full, varying = result["sampler"]
  assert full["lengths"] == "full" and varying["lengths"] == "varying"
  for r in (full, varying):
    # Kept tokens are the rows' lengths; computed positions are every row at every step.
    assert r["token_positions_computed"] == 2 * 2 * r["steps"] >= r["tokens_kept"] > 0
    assert r["wasted_frac"] == 1 - r["tokens_kept"] / r["token_positions_computed"]
    assert r["length_max"] == r["steps"] <= 12
  assert [u["attention_chunk"] for u in result["update"]] == [0, 8]  # S = 4 + 12: 2 chunks
  for update in result["update"]:
    assert update["T"] == 12 and update["temp_bytes"] > 0 and update["seconds"] > 0


def test_device_check_runs_at_tiny_size(tmp_path):
  # The prepared accelerator check, end to end on this machine's CPU at a toy shape.
  from experiments import device_check
  record = json.load(open(device_check.main(
      ["--tiny", "--out", str(tmp_path), "--plan", "configs/addition_tiny.py:smoke",
       "--plan-iterations", "2", "--plan-set", "mesh.num_devices=1"])))
  check = record["plan_check"]
  assert "error" not in check, check.get("traceback")
  # The CPU reports no memory statistics or peaks: the prediction stands alone here.
  assert check["predicted_peak_bytes"] > 0 and check["measured_iteration_s"] > 0
  assert set(check["plan"]["programs"]) == {"sample", "prepare", "update"}
  tiny = record["shapes"]["tiny"]
  assert "error" not in tiny["sampler"], tiny["sampler"].get("traceback")
  rows = {r["variant"]: r for r in tiny["sampler"]["rows"]}
  assert set(rows) == {"phased"}
  assert all(r["T"] == 6 and r["steps"] >= 1 and r["temp_bytes"] > 0 for r in rows.values())
  assert rows["phased"]["tokens_equal_phased"] and rows["phased"]["max_abs_logp_diff_phased"] == 0
  assert rows["phased"]["max_abs_logp_diff_teacher"] < 1e-4  # float32 cache: teacher forcing's
  (update,) = tiny["update"]
  assert "error" not in update and update["seconds"] > 0 and update["temp_bytes"] > 0
  assert record["machine"]["backend"] == "cpu" and len(record["load_average_before"]) == 3


def test_benchmark_without_record_leaves_the_checkout_clean(monkeypatch, capsys):
  # Trying a benchmark must not rewrite the committed results: without --record (or --out)
  # the record goes to runs/results/, which git ignores.
  before = _git("status", "--porcelain", "--", "experiments")
  if before.returncode != 0:
    pytest.skip("not a git checkout")
  monkeypatch.setattr(sys, "argv", ["benchmark.py", *TINY_LOGPROBS])
  runpy.run_module("experiments.benchmark", run_name="__main__")
  path = capsys.readouterr().out.split("wrote ")[-1].strip()
  assert path == os.path.join(ROOT, "runs", "results", "benchmark_logprobs.json")
  assert json.load(open(path))["result"]["abs_diff_sum_logp"] < 1e-3
  assert _git("check-ignore", "-q", path).returncode == 0  # 0: ignored
  assert _git("status", "--porcelain", "--", "experiments").stdout == before.stdout


def test_record_writes_the_committed_results():
  # --record resolves to the committed folder (checked without running a benchmark); --out
  # wins over both.
  build_parser = runpy.run_module("experiments.benchmark")["build_parser"]
  from experiments import _results
  out = lambda *argv: _results.out_path(build_parser().parse_args([*argv, "logprobs"]))
  committed = os.path.join(ROOT, "experiments", "results")
  assert out("--record") == committed
  assert os.path.exists(os.path.join(committed, "benchmark_logprobs.json"))
  assert out() == os.path.join(ROOT, "runs", "results")
  assert out("--record", "--out", "elsewhere") == "elsewhere"
  # The training experiments' folders resolve the same way (`_runs.main`, `--task long`).
  args = argparse.Namespace(out=None, record=True)
  assert _results.out_path(args, "gspo_vs_grpo_long") == os.path.join(committed,
                                                                       "gspo_vs_grpo_long")


TINY_UPDATE = ["--vocab", "64", "--hidden", "32", "--layers", "1", "--heads", "2",
               "--kv-heads", "1", "--head-dim", "16", "--mlp", "64", "--prompts", "4",
               "--group", "4", "--prompt-len", "4", "--new-tokens", "8", "--minibatches", "2",
               "--repeats", "1"]


def test_row_skip_timing_runs(tmp_path):
  """Both updates run on the same rows: the same loss and gradient norm, and with half the
  groups degenerate the skip leaves rows out of the backward pass."""
  from experiments import row_skip_timing
  out = tmp_path / "row_skip.json"
  row_skip_timing.main([*TINY_UPDATE, "--degenerate", "0.5", "--out", str(out)])
  (r,) = json.load(open(out))["results"]
  assert r["row_skip_saved_frac"] > 0 and r["row_skip_dead_frac"] >= 0.5
  assert abs(r["loss"][0] - r["loss"][1]) <= 1e-6 + 1e-5 * abs(r["loss"][0])
  assert abs(r["grad_norm"][0] - r["grad_norm"][1]) <= 1e-5 * r["grad_norm"][0]
  assert set(r["median_s"]) == {"full", "skip"} and r["paired_cpu_speedup"] > 0


def test_update_breakdown_runs(tmp_path):
  from experiments import update_breakdown
  out = tmp_path / "breakdown.json"
  update_breakdown.main([*TINY_UPDATE, "--out", str(out)])
  parts = json.load(open(out))["results"]["8"]
  assert set(parts) == {"forward", "loss_grad", "optimizer", "update", "loss_grad_1"}
  assert all(p["wall_s"] > 0 for p in parts.values())
  assert parts["update"]["gflop"] == 2 * parts["loss_grad"]["gflop"]   # two minibatches
