"""``--dtype`` of ``kvcore serve``/``kvcore run``: a bfloat16 server answers as ``LLM(dtype=
"bfloat16")`` does, reports its dtype, and bad values are refused in one line."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from kvcore.entrypoints.cli.main import main
from kvcore.models import dtype as cpu_dtype
from prometheus_client.parser import text_string_to_metric_families
from serve_util import ServerProcess, make_model_dir

PROMPTS = ["The cache", "A block of keys and values", "Hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny-chat-bf16"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(
        "--model", str(model_dir), "--served-model-name", "tiny", "--dtype", "bfloat16",
        "--num-blocks", "128", "--max-model-len", "256", "--threads", "1",
    )  # fmt: skip
    yield srv.wait_ready()
    assert srv.stop() == 0


def test_bf16_server_greedy_equals_llm_generate_bf16(server, model_dir):
    from kvcore import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", num_blocks=128, max_model_len=256)
    assert llm.engine.model.dtype == torch.bfloat16
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    fp32 = LLM(str(model_dir), num_blocks=128, max_model_len=256)
    assert fp32.engine.model.dtype == torch.float32  # auto: the checkpoint's dtype
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    got = client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, logprobs=1,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    for choice, want in zip(got.choices, ref, strict=True):
        assert choice.token_ids == want.outputs[0].token_ids
        assert choice.text == want.outputs[0].text
        lps = choice.logprobs.token_logprobs
        assert len(lps) == len(choice.token_ids)
        assert all(lp <= 0 and lp == lp for lp in lps)  # from float32 logits of a bf16 model


def test_bf16_server_reports_its_dtype(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    info = [
        s.labels
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvcore:cache_config_info"
    ]
    assert info and info[0]["model_dtype"] == "bfloat16" and info[0]["kv_dtype"] == "bfloat16"


@pytest.mark.parametrize("cmd", [["serve"], ["run"], ["generate", "x"]])
def test_bad_dtype_is_one_line_exit_2(cmd, capsys):
    assert main([*cmd, "--dtype", "fp8"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--dtype" in lines[0] and "invalid choice" in lines[0], err
    assert out == ""


def test_dtype_hint_only_for_auto_fp32_on_a_bf16_cpu(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(cpu_dtype, "cpu_has_native_bf16", lambda: True)
    assert "--dtype bfloat16" in cpu_dtype.dtype_hint("auto", torch.float32, cpu)
    assert cpu_dtype.dtype_hint("float32", torch.float32, cpu) is None  # asked for: no hint
    assert cpu_dtype.dtype_hint("auto", torch.bfloat16, cpu) is None
    assert cpu_dtype.dtype_hint("auto", torch.float32, cuda) is None
    monkeypatch.setattr(cpu_dtype, "cpu_has_native_bf16", lambda: False)
    assert cpu_dtype.dtype_hint("auto", torch.float32, cpu) is None
