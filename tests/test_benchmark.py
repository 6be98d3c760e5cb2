"""The benchmark script runs end to end at toy sizes (it measures; it asserts no speed)."""

import json
import runpy
import sys


def test_benchmark_logprobs_runs(tmp_path, monkeypatch, capsys):
  argv = ["benchmark.py", "--out", str(tmp_path), "logprobs", "--batch", "2", "--tokens", "16",
          "--width", "8", "--vocab", "64", "--chunk", "4", "--repeats", "1"]
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
  record = json.load(open(device_check.main(["--tiny", "--out", str(tmp_path)])))
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
