"""GGUF files into mlx-lm folders: the real SmolLM2 file and small synthetic llamas."""

import json
import struct

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from smollm2 import smollm2_dir

from llm_paged_mlx.models.gguf import convert_gguf, read_gguf_header
from llm_paged_mlx.models.loading import dequantize_model

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MLX_MODULES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGML_TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q6_K": 14}


# --- synthetic GGUF files -----------------------------------------------------------------

def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    spare = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(spare)) for b in range(256)]


TOKENS = SPECIALS + byte_level_alphabet() + ["he", "ll", "hell"]


def tiny_metadata(arch="llama") -> dict:
    return {
        "general.architecture": arch,
        f"{arch}.block_count": LAYERS,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def tiny_weights(seed=0) -> dict[str, np.ndarray]:
    """Random float32 weights of a 2-layer llama, by GGUF name, in MLX (out, in) shapes."""
    rng = np.random.default_rng(seed)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (len(TOKENS), HIDDEN)}
    for i in range(LAYERS):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (kv, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        })
    return {name: (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
                   else 0.1 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def save_with_mlx(path, metadata: dict, tensors: dict[str, np.ndarray]):
    """Write a GGUF with mx.save_gguf (it writes F32/F16 tensors only)."""

    def to_mlx(value):
        if isinstance(value, float):
            return mx.array(value, dtype=mx.float32)
        if isinstance(value, int):
            return mx.array(value, dtype=mx.uint32)
        if isinstance(value, list) and isinstance(value[0], int):
            return mx.array(value, dtype=mx.int32)
        return value

    mx.save_gguf(str(path), {k: mx.array(v) for k, v in tensors.items()},
                 {k: to_mlx(v) for k, v in metadata.items()})


def ggml_encode(x: np.ndarray, ggml_type: str) -> tuple[bytes, np.ndarray]:
    """GGML bytes of `x` (blocks of 32 along the last axis) and the values they decode to."""
    if ggml_type in ("F32", "F16"):
        y = x.astype(np.float32 if ggml_type == "F32" else np.float16)
        return y.tobytes(), y.astype(np.float32)
    blocks = x.reshape(-1, 32).astype(np.float32)
    if ggml_type == "Q8_0":
        d = (np.abs(blocks).max(1, keepdims=True) / 127).astype(np.float16)
        q = np.round(blocks / d.astype(np.float32)).clip(-127, 127).astype(np.int8)
        parts, decoded = [d.view(np.uint8), q.view(np.uint8)], q * d.astype(np.float32)
    else:
        if ggml_type == "Q4_0":  # symmetric: (q - 8) * d, d from the largest magnitude
            peak = np.take_along_axis(blocks, np.abs(blocks).argmax(1)[:, None], 1)
            d, m = (peak / -8).astype(np.float16), None
            zero = -8 * d.astype(np.float32)
        else:  # Q4_1: q * d + m
            lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
            d, m = ((hi - lo) / 15).astype(np.float16), lo.astype(np.float16)
            zero = m.astype(np.float32)
        q = np.round((blocks - zero) / d.astype(np.float32)).clip(0, 15).astype(np.uint8)
        nibbles = q[:, :16] | (q[:, 16:] << 4)
        parts = [d.view(np.uint8)] + ([] if m is None else [m.view(np.uint8)]) + [nibbles]
        decoded = q * d.astype(np.float32) + zero
    return np.concatenate(parts, axis=1).tobytes(), decoded.reshape(x.shape)


def write_gguf(path, metadata: dict, tensors: dict[str, tuple[str, np.ndarray]]) -> dict:
    """Write a GGUF v3 file with the given GGML types; return the decoded value of each tensor."""

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    def value(v) -> bytes:
        if isinstance(v, float):
            return struct.pack("<If", 6, v)
        if isinstance(v, int):
            return struct.pack("<II", 4, v)
        if isinstance(v, str):
            return struct.pack("<I", 8) + string(v)
        if isinstance(v[0], str):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(string(s) for s in v)
        return struct.pack(f"<IIQ{len(v)}i", 9, 5, len(v), *v)

    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    header += b"".join(string(k) + value(v) for k, v in metadata.items())
    data, decoded = b"", {}
    for name, (ggml_type, x) in tensors.items():
        raw, decoded[name] = ggml_encode(x, ggml_type)
        header += string(name) + struct.pack(f"<I{x.ndim}Q", x.ndim, *reversed(x.shape))
        header += struct.pack("<IQ", GGML_TYPE_IDS[ggml_type], len(data))
        data += raw + b"\0" * (-len(raw) % 32)
    path.write_bytes(header + b"\0" * (-len(header) % 32) + data)
    return decoded


def mlx_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{MLX_MODULES[parts[2]]}.weight"
    return f"{MLX_MODULES[parts[0]]}.weight"


def model_weights(model) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


@pytest.fixture
def float_gguf(tmp_path):
    """A tiny llama written by mx.save_gguf: attention in F16, the rest F32."""
    weights = {name: w.astype(np.float16) if ".attn_" in name and "norm" not in name else w
               for name, w in tiny_weights().items()}
    path = tmp_path / "tiny.gguf"
    save_with_mlx(path, tiny_metadata(), weights)
    return path, weights


def assert_nothing_left(out_dir):
    assert not out_dir.exists()
    assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}")]


# --- the real SmolLM2 file ----------------------------------------------------------------

def test_smollm2_config_keeps_gguf_quantization():
    config = json.loads((smollm2_dir() / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert config["vocab_size"] == 49152
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["max_position_embeddings"] == 8192 and config["tie_word_embeddings"] is True
    assert config["quantization"] == {
        "group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}
    }


def test_smollm2_answers_paris():
    model, tokenizer = mlx_lm.load(str(smollm2_dir()))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8 and model.model.layers[0].mlp.up_proj.bits == 4
    dequantize_model(model, "float32")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in answer


def test_smollm2_tokenizer_round_trip():
    _, tokenizer = mlx_lm.load(str(smollm2_dir()), lazy=True)
    texts = ["Hello, world!", "  two  spaces\nand a newline", "Ünïcödé — 日本語 🙂", "3.14159"]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.eos_token_ids == {2}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                        add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # system, user, assistant


# --- synthetic files ----------------------------------------------------------------------

def test_float_gguf_converts_and_runs(float_gguf, tmp_path):
    path, weights = float_gguf
    out = convert_gguf(path, tmp_path / "tiny")
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and config["tie_word_embeddings"] is False
    model, tokenizer = mlx_lm.load(str(out))
    loaded = model_weights(model)
    assert set(loaded) == {mlx_name(n) for n in weights}
    for name, w in weights.items():
        np.testing.assert_array_equal(loaded[mlx_name(name)], w.astype(np.float32))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float16

    ids = tokenizer.encode("hello")
    assert [TOKENS[i] for i in ids] == ["hell", "o"]
    logits = model(mx.array([ids]))
    assert logits.shape == (1, 2, len(TOKENS)) and mx.isfinite(logits).all().item()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True)
    assert chat[0] == 1
    assert tokenizer.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_float_gguf_cast_to_float16(float_gguf, tmp_path):
    out = convert_gguf(float_gguf[0], tmp_path / "tiny", dtype="float16")
    model, _ = mlx_lm.load(str(out))
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float16}


def test_quantized_gguf_keeps_bits_per_module(tmp_path):
    """Q8_0 embedding, Q4_0 attention, Q4_1 MLP, F16 output, F32 norms."""
    def ggml_type(name):
        if name == "token_embd.weight":
            return "Q8_0"
        if name == "output.weight" or name.endswith("norm.weight"):
            return "F16" if name == "output.weight" else "F32"
        return "Q4_0" if ".attn_" in name else "Q4_1"

    path = tmp_path / "q.gguf"
    tensors = {name: (ggml_type(name), w) for name, w in tiny_weights().items()}
    decoded = write_gguf(path, tiny_metadata(), tensors)
    assert read_gguf_header(path)[1]["blk.1.ffn_up.weight"] == "Q4_1"

    out = convert_gguf(path, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "lm_head": False,
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    model, _ = mlx_lm.load(str(out))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8
    assert isinstance(model.model.layers[1].self_attn.k_proj, nn.QuantizedLinear)
    assert type(model.lm_head) is nn.Linear
    tokens = mx.array([[5, 70, 200, 261]])
    quantized_logits = model(tokens)

    loaded = model_weights(dequantize_model(model, "float32"))
    for name, value in decoded.items():
        np.testing.assert_allclose(loaded[mlx_name(name)], value, atol=2e-3 * np.abs(value).max())
    np.testing.assert_allclose(np.array(model(tokens)), np.array(quantized_logits),
                               rtol=1e-2, atol=1e-2)

    float_model, _ = mlx_lm.load(str(convert_gguf(path, tmp_path / "f32", dtype="float32")))
    assert "quantization" not in json.loads((tmp_path / "f32" / "config.json").read_text())
    for name, value in model_weights(float_model).items():
        np.testing.assert_allclose(value, loaded[name], rtol=1e-6, atol=1e-6)


# --- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [0.5, 0.02], ids=["in-tensor-data", "in-header"])
def test_truncated_gguf(float_gguf, tmp_path, keep):
    data = float_gguf[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        convert_gguf(cut, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("prefix", [b"", b"GGUF\x03\x00\x00\x00"], ids=["random", "gguf-magic"])
def test_random_bytes(tmp_path, prefix):
    path = tmp_path / "random.gguf"
    path.write_bytes(prefix + np.random.default_rng(1).bytes(4096))
    with pytest.raises(ValueError, match="not a GGUF file|corrupt or truncated"):
        convert_gguf(path, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_other_architecture(tmp_path):
    path = tmp_path / "qwen.gguf"
    save_with_mlx(path, tiny_metadata("qwen2"), tiny_weights())
    with pytest.raises(ValueError, match="architecture 'qwen2' is not supported"):
        convert_gguf(path, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "k.gguf"
    write_gguf(path, tiny_metadata(), {n: ("F32", w) for n, w in tiny_weights().items()})
    # Relabel one tensor as Q6_K in the header: the converter must refuse before reading data.
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_down.weight"
    type_at = data.index(name) + len(name) + 4 + 2 * 8
    data[type_at:type_at + 4] = struct.pack("<I", GGML_TYPE_IDS["Q6_K"])
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor types Q6_K \(1 tensors\)"):
        convert_gguf(path, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_unknown_tensor_name(tmp_path):
    path = tmp_path / "extra.gguf"
    weights = tiny_weights()
    weights["rope_freqs.weight"] = np.ones(8, dtype=np.float32)
    save_with_mlx(path, tiny_metadata(), weights)
    with pytest.raises(ValueError, match="GGUF tensors 'rope_freqs.weight' are not supported"):
        convert_gguf(path, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_existing_output_is_left_alone(float_gguf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        convert_gguf(float_gguf[0], out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
