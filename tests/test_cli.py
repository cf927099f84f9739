"""The kvcore command: the main job's report, a single completion, clear errors, Ctrl-C."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvcore.entrypoints.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^([a-z0-9_]+): (-?[0-9.]+(?:e[-+]?[0-9]+)?|nan)(?: (\S.*))?$")
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "python"), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")]
    ),
    "OMP_WAIT_POLICY": "PASSIVE",
    "PYTHONUNBUFFERED": "1",
}


def kvcore(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcore", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=ROOT,
    )


def test_run_prints_the_report(capsys, tmp_path):
    path = tmp_path / "report.json"
    argv = ["run", "--conversations", "2", "--max-tokens", "3", "--threads", "1"]
    assert main([*argv, "--format", "lines", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    figures = {}
    for line in out.strip().splitlines():
        m = LINE.match(line)
        assert m, line  # every line is `name: value unit`
        figures[m.group(1)] = float(m.group(2))
    for name in (
        "kvcore_tok_per_s",
        "kvcore_ttft_p50_ms",
        "kvcore_itl_p99_ms",
        "kvcore_prefix_hit_rate_pct",
        "kvcore_peak_kv_usage_pct",
        "kvcore_kv_waste_pct",
        "kvcore_preemptions",
        "kvcore_engine_overhead_pct",
    ):
        assert name in figures, name
    assert figures["kvcore_requests"] >= 2  # follow-up turns were submitted as answers came back
    report = json.loads(path.read_text())
    assert report["interrupted"] is False
    assert report["figures"]["kvcore_requests"]["value"] == figures["kvcore_requests"]
    assert report["figures"]["kvcore_tok_per_s"]["unit"] == "tok/s"


def test_run_prints_a_table_by_default(capsys):
    assert main(["run", "--conversations", "1", "--max-tokens", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "output throughput" in out and "time to first token, p50" in out
    assert "tok/s" in out and "kvcore_" not in out


def test_generate_streams_a_completion(capsys):
    assert main(["generate", "Say hi.", "--max-tokens", "4", "--threads", "1"]) == 0
    assert capsys.readouterr().out.strip()


def test_errors_are_reported_not_raised(capsys):
    assert main(["generate", "x", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "tiny-llama", "--max-tokens", "0"]) == 2
    assert main(["generate", "x", "--model", "tiny-llama"]) == 2  # no tokenizer for text
    assert "no tokenizer" in capsys.readouterr().err


BAD_ARGS = [
    ["generate", "x", "--device", "tpu"],
    ["generate", "x", "--threads", "-1"],
    ["run", "--compare", "--compare-batch", "0"],
    ["run", "--conversations", "0"],
    ["run", "--kv-memory-mb", "0"],
    ["run", "--temperature", "nan"],
    ["--max-tokens", "-3"],  # no command: run
    ["plan", "--config", "config.json", "--memory", "1e400"],
    ["plan", "--config", sys.executable, "--memory", "1GiB"],  # a binary file
    ["plan", "--config", "config.json", "--memory", "1GiB", "--kivi-window", "-1000"],
    ["eval-kv", "--prompts", "-1", "--ppl-seqs", "0"],
    ["eval-kv", "--chunk", "0"],
    ["eval-kv", "--needle-lengths", "abc"],
    ["eval-kv", "--formats", "kivi2", "--ppl-len", "128", "--chunk", "256"],
    ["bogus"],
    ["run", "--dtype", "fp8"],
]


def _with_config(args: list[str], tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
    )
    return [str(tmp_path / a) if a == "config.json" else a for a in args]


@pytest.mark.parametrize("args", BAD_ARGS, ids=lambda a: " ".join(a))
def test_bad_arguments_give_one_line_and_exit_2(args, tmp_path, capsys):
    assert main(_with_config(args, tmp_path)) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    assert out == ""


@pytest.mark.parametrize("index", [0, 3, 8, 12], ids=lambda i: " ".join(BAD_ARGS[i]))
def test_bad_arguments_from_the_shell(index, tmp_path):
    r = kvcore(*_with_config(BAD_ARGS[index], tmp_path))  # python -m kvcore ...
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], r.stderr
    assert r.stdout == ""


def test_a_missing_gpu_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = kvcore("generate", "x", "--model", "tiny-llama", "--device", "cuda")
    assert r.returncode == 2 and "CUDA is not available" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_plan_reports_no_negative_capacity(tmp_path):
    (tmp_path / "c.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
    )
    r = kvcore("plan", "--config", str(tmp_path / "c.json"), "--memory", "1", "--formats", "auto")
    assert r.returncode == 0, r.stderr
    row = r.stdout.strip().splitlines()[-1].split()
    assert row[0] == "auto" and row[-3:] == ["0", "0", "0"]  # tokens, requests, windowed


def test_help_and_python_dash_m():
    r = kvcore("--help")
    assert r.returncode == 0 and "``" not in r.stdout
    assert "kvcore run" in r.stdout and "generate" in r.stdout and "examples:" in r.stdout
    for sub in ("run", "generate", "plan", "eval-kv"):
        assert kvcore(sub, "--help").returncode == 0, sub


def _interrupt(args: list[str], ready: re.Pattern, stream: str) -> subprocess.CompletedProcess:
    """Start ``python -m kvcore args``, send SIGINT once ``ready`` shows up on ``stream``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        cwd=ROOT,
    )
    watched = proc.stderr if stream == "stderr" else proc.stdout
    assert watched is not None
    os.set_blocking(watched.fileno(), False)
    seen, deadline = b"", time.monotonic() + 240
    try:
        while not ready.search(seen.decode(errors="replace")):
            assert proc.poll() is None, "exited before it was interrupted"
            assert time.monotonic() < deadline, "never got ready"
            seen += watched.read() or b""
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = {"stdout": out, "stderr": err}
    text[stream] = seen + text[stream]
    return subprocess.CompletedProcess(args, proc.returncode, *(text[k].decode() for k in text))


def test_ctrl_c_on_run_prints_the_partial_report():
    args = ["run", "--conversations", "2", "--threads", "1", "--format", "lines"]
    r = _interrupt(args, re.compile(r"step [1-9]"), "stderr")
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr
    assert "interrupted after" in r.stderr
    names = [LINE.match(line).group(1) for line in r.stdout.strip().splitlines()]
    assert "kvcore_requests" in names and "kvcore_steps" in names


def test_ctrl_c_on_generate_stops_the_stream():
    args = ["generate", "Tell me a long story.", "--max-tokens", "2000", "--threads", "1"]
    r = _interrupt(args, re.compile(r"\S"), "stdout")
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr and "interrupted" in r.stderr


def test_console_script_is_installed():
    assert shutil.which("kvcore") or shutil.which("kvcore", path=".venv/bin")


def test_compare_runs_transformers_at_its_best_dtype(capsys):
    """``--compare``'s peer: the engine's model, except half precision on a CPU where
    transformers' bf16 GEMM is slower than fp32 (there: an fp32 copy of the same weights)."""
    import argparse

    import torch
    from kvcore import LLM
    from kvcore.entrypoints.cli.main import compare_model
    from kvcore.models.dtype import cpu_runs_bf16

    args = argparse.Namespace(model="tiny-llama", seed=3)
    fp32 = LLM("tiny-llama", seed=3, num_blocks=16)
    assert compare_model(fp32, args) is fp32.engine.model
    bf16 = LLM("tiny-llama", seed=3, num_blocks=16, dtype="bfloat16")
    peer = compare_model(bf16, args)
    if cpu_runs_bf16(False):
        assert peer is bf16.engine.model
        return
    assert peer.dtype == torch.float32 and "float32" in capsys.readouterr().err
    want = {k: v.float() for k, v in bf16.engine.model.state_dict().items()}
    got = peer.state_dict()
    assert want.keys() == got.keys()
    # the same checkpoint: each fp32 weight rounds to the engine's bf16 one
    assert all(torch.equal(got[k].bfloat16().float(), want[k]) for k in want)
