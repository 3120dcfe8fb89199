"""Convert a llama-architecture GGUF file into a folder that `mlx_lm.load` reads.

`mx.load` reads the tensors (Q4_0, Q4_1 and Q8_0 come back MLX-quantized: weight, scales and
biases with group size 32). It does not say which GGML type each tensor had, and it silently
turns other quantized types into float16, so the header is read here first: that gives the
metadata, the tensor types to check, and clear errors for files that are not GGUF at all.
"""

import json
import mmap
import os
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
GROUP_SIZE = 32  # the block size of every GGML type MLX keeps quantized

_GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
}
_FLOAT_TYPES = {"F32", "F16"}
_QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# GGUF metadata value types: struct formats of the scalars, then string and array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

_TOP_MODULES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
_LAYER_MODULES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Pre-tokenizers by `tokenizer.ggml.pre`, as llama.cpp splits text before byte-level BPE.
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
_PRE_TOKENIZERS = {
    "default": _BYTE_LEVEL,
    "gpt2": _BYTE_LEVEL,
    **{name: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL])
       for name in ("smollm", "starcoder", "refact", "codeshell")},
}


def convert_gguf(gguf_path, out_dir, *, dtype=None) -> Path:
    """Convert a llama GGUF file into an mlx-lm model folder at `out_dir` and return its path.

    dtype=None keeps Q4_0/Q4_1/Q8_0 tensors quantized (config.json then carries the bits of
    each module); "float32", "float16" or "bfloat16" dequantizes them and casts every float
    tensor to that dtype. The folder is built next to `out_dir` and renamed into place, so it
    either appears complete or not at all. Raises ValueError for corrupt files and unsupported
    architectures, tensor types or tokenizers; FileExistsError if `out_dir` exists.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be None or one of {', '.join(_DTYPES)}, not {dtype!r}")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")

    metadata, tensor_types = read_gguf_header(gguf_path)
    config = _model_config(gguf_path, metadata)
    _check_tensors(gguf_path, tensor_types)
    tokenizer, tokenizer_config = _build_tokenizer(gguf_path, metadata)
    weights, quantization = _convert_tensors(gguf_path, tensor_types, _DTYPES.get(dtype))
    config["vocab_size"] = weights["model.embed_tokens.weight"].shape[0]
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    if quantization:
        config["quantization"] = quantization

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        try:
            os.rename(tmp, out_dir)
        except OSError as e:
            raise FileExistsError(f"{out_dir} appeared while converting {gguf_path}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_gguf_header(path) -> tuple[dict, dict[str, str]]:
    """Return a GGUF file's metadata and each tensor's GGML type name ("F32", "Q4_0", ...)."""
    path = Path(path)
    if path.stat().st_size < 24:
        raise ValueError(f"{path} is not a GGUF file (only {path.stat().st_size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<4sI", buf)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
        try:
            return _parse_header(_Cursor(buf, pos=8))
        except (ValueError, struct.error) as e:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"{path} is a corrupt or truncated GGUF file: {e}") from e


class _Cursor:
    """Reads little-endian GGUF values from a buffer, raising ValueError past its end."""

    def __init__(self, buf, pos: int):
        self.buf, self.pos = buf, pos

    def take(self, fmt: str, count: int = 1) -> tuple:
        fmt = "<" + (fmt if count == 1 else f"{count}{fmt}")
        size = struct.calcsize(fmt)
        self._check_room(size)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self.take("Q")
        self._check_room(length)
        self.pos += length
        return self.buf[self.pos - length:self.pos].decode("utf-8")

    def value(self, value_type: int):
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.take("IQ")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            return list(self.take(self._format(item_type), count))
        return self.take(self._format(value_type))[0]

    def _check_room(self, size: int) -> None:
        if self.pos + size > len(self.buf):
            raise ValueError(f"the header runs past the end of the file ({len(self.buf)} bytes)")

    @staticmethod
    def _format(value_type: int) -> str:
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return _SCALAR_FORMATS[value_type]


def _parse_header(cursor: _Cursor) -> tuple[dict, dict[str, str]]:
    n_tensors, n_kv = cursor.take("QQ")
    metadata = {}
    for _ in range(n_kv):
        key = cursor.string()
        (value_type,) = cursor.take("I")
        metadata[key] = cursor.value(value_type)
    tensor_types = {}
    for _ in range(n_tensors):
        name = cursor.string()
        (n_dims,) = cursor.take("I")
        cursor.take("Q", n_dims)
        type_id, _offset = cursor.take("IQ")
        tensor_types[name] = _GGML_TYPES.get(type_id, f"GGML type {type_id}")
    return metadata, tensor_types


def _model_config(path: Path, metadata: dict) -> dict:
    """The mlx-lm llama config.json (without the tensor-derived fields) from GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")

    def get(key, default=None):
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata has no 'llama.{key}'")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings are not supported")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _tidy(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _tidy(get("rope.freq_base", 10000.0)),
        "rope_traditional": True,  # GGUF permutes q/k rows for interleaved RoPE
        "max_position_embeddings": get("context_length"),
    }
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _tidy(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported")
    for name in ("bos", "eos"):
        if f"tokenizer.ggml.{name}_token_id" in metadata:
            config[f"{name}_token_id"] = metadata[f"tokenizer.ggml.{name}_token_id"]
    return config


def _tidy(value: float) -> float:
    """Drop float32 noise from a metadata float (9.999999747e-06 -> 1e-05)."""
    return float(f"{value:.7g}")


def _check_tensors(path: Path, tensor_types: dict[str, str]) -> None:
    """Refuse tensor types and names the conversion does not handle, before loading any data."""
    unsupported = Counter(t for t in tensor_types.values()
                          if t not in _FLOAT_TYPES and t not in _QUANT_BITS)
    if unsupported:
        found = ", ".join(f"{t} ({n} tensors)" for t, n in unsupported.items())
        raise ValueError(f"{path}: unsupported GGUF tensor types {found}; "
                         "supported: F32, F16, Q4_0, Q4_1, Q8_0")
    unknown = [name for name in tensor_types if _mlx_module(name) is None]
    if unknown:
        raise ValueError(f"{path}: GGUF tensors {', '.join(map(repr, unknown))} are not "
                         "supported for llama")
    if "token_embd.weight" not in tensor_types:
        raise ValueError(f"{path}: the GGUF file has no token_embd.weight")


def _mlx_module(gguf_name: str) -> str | None:
    """mlx-lm's module for a GGUF tensor: blk.3.attn_q.weight is model.layers.3.self_attn.q_proj."""
    module, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        return None
    if module in _TOP_MODULES:
        return _TOP_MODULES[module]
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_MODULES:
        return f"model.layers.{parts[1]}.{_LAYER_MODULES[parts[2]]}"
    return None


def _convert_tensors(path: Path, tensor_types: dict[str, str], dtype) -> tuple[dict, dict]:
    """Rename the GGUF tensors to mlx-lm names; return them and the `quantization` config."""
    try:
        tensors = mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: {e}") from e

    weights, bits = {}, {}
    float_matrices = []
    for name, ggml_type in tensor_types.items():
        module, prefix = _mlx_module(name), name.removesuffix(".weight")
        if ggml_type in _QUANT_BITS:
            weight, scales, biases = (tensors[f"{prefix}.{part}"]
                                      for part in ("weight", "scales", "biases"))
            if dtype is None:
                weights.update({f"{module}.weight": weight, f"{module}.scales": scales,
                                f"{module}.biases": biases})
                bits[module] = _QUANT_BITS[ggml_type]
            else:
                weights[f"{module}.weight"] = mx.dequantize(
                    weight, scales.astype(dtype), biases.astype(dtype),
                    group_size=GROUP_SIZE, bits=_QUANT_BITS[ggml_type],
                )
        else:
            tensor = tensors[name]
            weights[f"{module}.weight"] = tensor if dtype is None else tensor.astype(dtype)
            if tensor.ndim == 2:
                float_matrices.append(module)
    return weights, _quantization_config(bits, float_matrices)


def _quantization_config(bits: dict[str, int], float_matrices: list[str]) -> dict:
    """mlx-lm's `quantization`: the most common bits, then per-module exceptions."""
    if not bits:
        return {}
    default = Counter(bits.values()).most_common(1)[0][0]
    config = {"group_size": GROUP_SIZE, "bits": default}
    config.update({module: {"group_size": GROUP_SIZE, "bits": b}
                   for module, b in bits.items() if b != default})
    config.update({m: False for m in float_matrices})
    return config


def _build_tokenizer(path: Path, metadata: dict) -> tuple[Tokenizer, dict]:
    """A byte-level BPE `tokenizers.Tokenizer` and its tokenizer_config.json from GGUF metadata."""
    model, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre", "default")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if model != "gpt2":
        raise ValueError(f"{path}: GGUF tokenizer model {model!r} is not supported (only 'gpt2')")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported")
    if not tokens:
        raise ValueError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
    token_types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]

    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]
    tokenizer.decoder = decoders.ByteLevel()
    # Type 3 tokens are control tokens (special), type 4 user-defined (added, not special).
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False)
         for t, token_type in zip(tokens, token_types) if token_type == 3]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False)
         for t, token_type in zip(tokens, token_types) if token_type == 4]
    )

    def token(name):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return None if token_id is None else tokens[token_id]

    bos = token("bos")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B",
            special_tokens=[(bos, metadata["tokenizer.ggml.bos_token_id"])],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False,
                                                        trim_offsets=False)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata.get("llama.context_length", 2048),
    }
    for name, key in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                      ("padding", "pad_token")):
        if token(name) is not None:
            config[key] = token(name)
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return tokenizer, config
