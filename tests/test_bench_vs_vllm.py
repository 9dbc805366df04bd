"""scripts/bench_vs_vllm.py without running a benchmark: --ours picks our servers (float, quantized), each
server's command line (ours-float serves the embedded float checkpoint through jobs.serve), and the summary
and README table computed from recorded rounds (medians, ranges, ratios to vLLM)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_vs_vllm", REPO / "scripts" / "bench_vs_vllm.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def args(*extra: str) -> argparse.Namespace:
    return bench.build_parser().parse_args(["--vllm-venv", "/nonexistent", *extra])


def test_ours_picks_the_servers_and_refuses_unknown_choices(capsys):
    assert args().ours == ["ours-float", "ours-quantized"]
    assert args("--ours", "quantized").ours == ["ours-quantized"]
    assert args("--ours", "float").ours == ["ours-float"]
    for bad in ("fp8", "float,float", ""):
        with pytest.raises(SystemExit):
            args("--ours", bad)
        assert "--ours takes a comma-separated subset of float, quantized, float-serve-proxy, quantized-serve-proxy" \
            in capsys.readouterr().err
    assert args("--ours", "quantized,quantized-serve-proxy").ours == ["ours-quantized", "ours-quantized-serve-proxy"]


def test_server_commands():
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.engine.worker.loader import FLOAT_CHECKPOINT, dir_kind

    cmd, _ = bench.server_command("ours-float", args("--float-dtype", "bfloat16"), 9000)
    assert cmd[1:] == ["-m", "jobs.serve", "--model-path", EMBEDDED_MODEL_DIR, "--served-model-name", "ours-float",
                       "--port", "9000", "--dtype", "bfloat16"]
    assert dir_kind(cmd[4]) == FLOAT_CHECKPOINT
    from jobs import serve

    parsed = serve.parse_args(cmd[3:])     # jobs.serve takes exactly these flags
    assert (parsed.model_path, parsed.served_model_name, parsed.port, parsed.dtype) == (
        EMBEDDED_MODEL_DIR, "ours-float", 9000, "bfloat16")
    cmd, _ = bench.server_command("ours-quantized", args(), 9000)
    assert cmd[3:6] == ["--model-path", str(bench.QUANTIZED), "--served-model-name"] and "--dtype" not in cmd
    assert serve.parse_args(cmd[3:]).http_proxy == "auto"
    cmd, _ = bench.server_command("ours-quantized-serve-proxy", args(), 9000)
    assert cmd[4] == str(bench.QUANTIZED) and cmd[-2:] == ["--http-proxy", "serve"]
    assert serve.parse_args(cmd[3:]).http_proxy == "serve"
    cmd, _ = bench.server_command("ours-float-serve-proxy", args(), 9000)
    assert cmd[4] == EMBEDDED_MODEL_DIR and cmd[-4:] == ["--dtype", "auto", "--http-proxy", "serve"]
    cmd, env = bench.server_command("vllm", args(), 9000)
    assert cmd[2:4] == ["serve", str(bench.MODEL_DIR)] and "bfloat16" in cmd and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_summary_and_table_have_a_row_per_server():
    def run(tput, tpot):
        return {"output_throughput": tput, "median_tpot_ms": tpot, "median_ttft_ms": 100.0, "median_itl_ms": tpot}

    rounds = [{"ours-float": {1: run(f, 20.0)}, "ours-quantized": {1: run(q, 10.0)}, "vllm": {1: run(v, 40.0)}}
              for f, q, v in ((50, 100, 25), (60, 90, 20), (40, 110, 30))]
    s = bench.summarize(rounds)
    assert s["ours-float"][1]["output_throughput"] == {"median": 50, "range": [40, 60]}
    assert s["ratio"] == {"ours-float": {1: {"output_throughput": 2.0, "median_tpot_ms": 0.5}},
                          "ours-quantized": {1: {"output_throughput": 4.0, "median_tpot_ms": 0.25}}}
    rows = bench.table(s).splitlines()
    assert rows[2:] == ["| 1 | dsquant, float (bf16 checkpoint) | 50 | 2.00x | 20.0 | 100.0 |",
                        "| 1 | dsquant, W8A8 + FA3 | 100 | 4.00x | 10.0 | 100.0 |",
                        "| 1 | vLLM CPU, bf16 | 25 | 1.00x | 40.0 | 100.0 |"]


def test_every_run_sends_new_prompts_and_every_server_of_a_round_the_same():
    """vllm bench serve's default seed sends the same prompts to every run: from the second run on a
    prefix-caching server would skip their prefill. Each (round, concurrency) gets its own --seed."""
    seeds = {(r, c): bench.prompt_seed(r, c) for r in range(3) for c in (0, 1, 4, 8, 16)}
    assert len(set(seeds.values())) == len(seeds)
    assert bench.prompt_seed(2, 16) == bench.prompt_seed(2, 16)          # a function of the run alone
