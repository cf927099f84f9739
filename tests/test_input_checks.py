"""Every bad input gets one typed line before anything loads or binds (issue 28, item 6):
``LLM(...)`` raises an ``InvalidArgumentError`` (a ``KvCoreError``), the CLI prints one
``kvcore ...: error:`` line and exits 2, never a traceback."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from kvcore import LLM, InvalidArgumentError, KvCoreError
from kvcore.entrypoints.cli.main import main
from kvcore.models.loader import tiny_llama

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=64, vocab_size=64, max_position_embeddings=64)  # fmt: skip
REFUSED: list[str] = []  # ids of the inputs refused in this module (the report counts them)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good-model")
    tiny_llama(seed=0, **SMALL).save_pretrained(path)
    return path


def _broken(tmp_path, model_dir, name, content):
    path = tmp_path / "broken"
    shutil.copytree(model_dir, path)
    target = path / name
    if content is None:
        target.unlink()
        target.mkdir()  # a folder where a file should be
    else:
        target.write_bytes(content)
    return path


BROKEN_FOLDERS = {
    "config-not-json": ("config.json", b"{not json"),
    "config-not-utf8": ("config.json", b"\xff\xfe\x00garbage"),
    "config-a-list": ("config.json", b"[1, 2]"),
    "config-a-folder": ("config.json", None),
    "safetensors-garbage": ("model.safetensors", b"garbage, not a safetensors file" * 4),
    "safetensors-short": ("model.safetensors", b"\x01\x02"),
    "safetensors-huge-header": ("model.safetensors", struct.pack("<Q", 1 << 40) + b"{}"),
    "safetensors-bad-offsets": (
        "model.safetensors",
        struct.pack("<Q", 60)
        + json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 999]}})
        .encode()
        .ljust(60),
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FOLDERS))
def test_broken_model_folder_is_one_typed_error(tmp_path, model_dir, case):
    name, content = BROKEN_FOLDERS[case]
    path = _broken(tmp_path, model_dir, name, content)
    with pytest.raises(InvalidArgumentError) as info:
        LLM(str(path))
    assert "\n" not in str(info.value)
    REFUSED.append(f"LLM:{case}")


BAD_KWARGS = {
    "dtype-int32": {"dtype": torch.int32},
    "dtype-name": {"dtype": "int8"},
    "seed-2**70": {"seed": 2**70},
    "seed-float": {"seed": 1.5},
    "tokenizer-5": {"tokenizer": 5},
    "tokenizer-missing-path": {"tokenizer": "/nonexistent/tokenizer"},
    "enforce_eager-no": {"enforce_eager": "no"},
    "compile-yes": {"compile": "yes"},
    "threads-0": {"threads": 0},
    "max_model_len-1": {"max_model_len": 1},
    "disk_path-proc": {"disk_path": "/proc/kvcore-tier", "host_kv_bytes": 1 << 20},
    "tier_secret_file-missing": {"tier_secret_file": "/nonexistent/secret"},
}


@pytest.mark.parametrize("case", sorted(BAD_KWARGS))
def test_bad_constructor_argument_is_one_typed_error(model_dir, case, monkeypatch):
    import kvcore.engine.builder as builder

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(builder, "load_model", no_load)
    with pytest.raises(InvalidArgumentError) as info:
        LLM(str(model_dir), **BAD_KWARGS[case])
    assert "\n" not in str(info.value)
    REFUSED.append(f"LLM:{case}")


def test_disk_path_on_a_file_and_an_open_secret_are_refused(tmp_path, model_dir):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        LLM(str(model_dir), disk_path=str(f), host_kv_bytes=1 << 20)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o644)
    with pytest.raises(InvalidArgumentError, match="chmod 600"):
        LLM(str(model_dir), tier_secret_file=str(secret))
    secret.chmod(0o600)
    secret.write_text("short")
    with pytest.raises(KvCoreError, match="shorter"):
        LLM(str(model_dir), tier_secret_file=str(secret))
    REFUSED.extend(["LLM:disk_path-file", "LLM:secret-mode", "LLM:secret-short"])


def _cli(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_cli_refusals_are_one_line_exit_2(tmp_path, model_dir, capsys):
    c7 = tmp_path / "c7.json"
    c7.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 7,
                              "num_key_value_heads": 7, "num_hidden_layers": 2,
                              "vocab_size": 100}))  # fmt: skip
    cs = tmp_path / "cs.json"
    cs.write_text(json.dumps({"model_type": "llama", "hidden_size": "big",
                              "num_attention_heads": 4, "num_hidden_layers": 2}))  # fmt: skip
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    garbage = _broken(tmp_path, model_dir, "model.safetensors", b"garbage" * 10)
    url = "http://127.0.0.1:9"
    cases = {
        "serve --port 70000": ["serve", "--port", "70000"],
        "serve --max-n 0": ["serve", "--max-n", "0"],
        "serve --max-body-bytes 0": ["serve", "--max-body-bytes", "0"],
        "serve --shutdown-grace-s inf": ["serve", "--shutdown-grace-s", "inf"],
        "serve garbage safetensors": ["serve", "--model", str(garbage), "--port", "0"],
        "serve --tier-secret-file missing": [
            "serve", "--model", str(model_dir), "--tier-secret-file", "/nonexistent"],
        "plan 7 heads": ["plan", "--config", str(c7), "--memory", "1GiB"],
        "plan string hidden_size": ["plan", "--config", str(cs), "--memory", "1GiB"],
        "bench": ["bench"],
        "bench serve --from-json {}": ["bench", "serve", "--from-json", str(empty)],
        "bench serve --request-rate 0": [
            "bench", "serve", "--base-url", url, "--request-rate", "0"],
        "bench serve --request-rate -1": [
            "bench", "serve", "--base-url", url, "--request-rate", "-1"],
        "bench serve --request-rate nan": [
            "bench", "serve", "--base-url", url, "--request-rate", "nan"],
        "bench serve --max-tokens 0": ["bench", "serve", "--base-url", url, "--max-tokens", "0"],
        "run --seed 2**70": ["run", "--model", str(model_dir), "--seed", str(2**70)],
    }  # fmt: skip
    for name, argv in cases.items():
        code, err = _cli(argv, capsys)
        assert code == 2, (name, code, err)
        lines = err.splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], (name, err)
        assert "Traceback" not in err
        REFUSED.append(f"CLI:{name}")


def test_report_refused_count():
    """Prints the number of refused inputs of this module (issue 28's report)."""
    if not REFUSED:
        pytest.skip("run with the module's other tests")
    print(f"refused_inputs: {len(REFUSED)}")
