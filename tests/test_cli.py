"""The kvcore command: the main job's report, a single completion, clear errors."""

import shutil

from kvcore.cli import main


def test_run_prints_the_report(capsys):
    code = main(["run", "--conversations", "2", "--max-tokens", "3", "--threads", "1"])
    assert code == 0
    out = capsys.readouterr().out
    for name in (
        "kvcore_tok_per_s:",
        "kvcore_ttft_p50_ms:",
        "kvcore_itl_p99_ms:",
        "kvcore_prefix_hit_rate_pct:",
        "kvcore_peak_kv_usage_pct:",
        "kvcore_kv_waste_pct:",
        "kvcore_preemptions:",
        "kvcore_engine_overhead_pct:",
    ):
        assert name in out, name
    turns = int(out.split("kvcore_requests: ")[1].split()[0])
    assert turns >= 2  # follow-up turns were submitted as answers came back


def test_generate_streams_a_completion(capsys):
    assert main(["generate", "Say hi.", "--max-tokens", "4", "--threads", "1"]) == 0
    assert capsys.readouterr().out.strip()


def test_errors_are_reported_not_raised(capsys):
    assert main(["generate", "x", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "tiny-llama", "--max-tokens", "0"]) == 2


def test_console_script_is_installed():
    assert shutil.which("kvcore") or shutil.which("kvcore", path=".venv/bin")
