"""The block file format: one full KV block as a safetensors file, and every check a file must pass.

A block file holds the pool arrays' rows of one block, named as ``ModelRunner.block_layout``
names them (k.0, v.0, k.1, ...; an MLA layer latent.0; quantized rows add k_scales.0, k_biases.0, ..., and
keys stored rotated are k_rotated.0, ...), the
block's token ids (int64), and string metadata:
format name and version, model id, chain hash, and a checksum over the token ids and
K/V bytes. numpy has no bfloat16, so bfloat16 K/V is stored as its raw 16 bits (uint16).
``decode`` trusts nothing in a file before checking it: every way a file can be
malformed, or belong to another model or block, raises ``BadBlockFile`` with the reason.
"""

import hashlib
import json
import math
from typing import BinaryIO, Sequence

import mlx.core as mx
import numpy as np
from safetensors.numpy import save as safetensors_bytes

FORMAT = "llm-paged-mlx-kv"
VERSION = "1"
MAX_HEADER_BYTES = 1 << 20  # a block's header is a few KB; a larger length is damage, not a size to allocate

# safetensors' names of the dtypes a block file can hold
_DTYPE_NAMES = {
    np.dtype(name): code
    for name, code in [("float32", "F32"), ("float16", "F16"), ("uint16", "U16"), ("int64", "I64"), ("int32", "I32"),
                       ("int8", "I8"), ("uint8", "U8"), ("uint32", "U32")]
}


class BadBlockFile(Exception):
    """Why a block file cannot be used: its content is malformed, or it holds another model's or block's K/V."""


def host(array: mx.array) -> np.ndarray:
    """A numpy copy of an evaluated array (bfloat16 travels as its raw 16 bits)."""
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


def device(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """The MLX array of ``dtype`` that ``host`` turned into ``array``."""
    return mx.array(array).view(dtype) if dtype == mx.bfloat16 else mx.array(array)


def storage_dtype(dtype: mx.Dtype) -> np.dtype:
    """The numpy dtype a file stores an MLX dtype as."""
    return np.dtype("uint16" if dtype == mx.bfloat16 else str(dtype).rsplit(".", 1)[-1])


def checksum(token_ids: np.ndarray, kv: Sequence[np.ndarray]) -> str:
    digest = hashlib.blake2b(token_ids.tobytes(), digest_size=16)
    for array in kv:
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def encode(token_ids: np.ndarray, kv: Sequence[np.ndarray], names: Sequence[str], model_id: str, chain_hash: bytes) -> bytes:
    """The file of one block: its token ids (int64) and its host K/V arrays, in ``read_blocks`` order, named."""
    arrays = {"token_ids": token_ids, **dict(zip(names, kv))}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model_id": model_id,
        "chain_hash": chain_hash.hex(),
        "checksum": checksum(token_ids, kv),
    }
    return safetensors_bytes(arrays, metadata=meta)


def max_file_size(num_tokens: int, layout) -> int:
    """The most bytes a file of a block of ``num_tokens`` tokens and ``layout`` can hold: its header, at most
    ``MAX_HEADER_BYTES``, and its data."""
    data = num_tokens * np.dtype("int64").itemsize
    data += sum(math.prod(shape) * storage_dtype(dtype).itemsize for _, shape, dtype in layout)
    return 8 + MAX_HEADER_BYTES + data


def read_metadata(file: BinaryIO, file_size: int) -> dict:
    """The metadata of an open file, reading its header only (never more than ``file_size`` bytes)."""
    length = header_length(file.read(8), file_size)
    return parse_header(file.read(length))[1]


def header_length(prefix: bytes, file_size: int) -> int:
    """The header length the file's first 8 bytes declare, if it fits in the file and is a plausible size."""
    if len(prefix) < 8:
        raise BadBlockFile("is too short to be a safetensors file")
    length = int.from_bytes(prefix[:8], "little")
    if length > min(MAX_HEADER_BYTES, file_size - 8):
        raise BadBlockFile(f"declares a {length}-byte header in a {file_size}-byte file (corrupt or truncated)")
    return length


def parse_header(raw: bytes) -> tuple[dict, dict]:
    """The tensor entries and the metadata of a safetensors header."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # not UTF-8 or not JSON; or nested deeper than the parser goes
        raise BadBlockFile("has a header that is not JSON (corrupt or not a block file)") from None
    if not isinstance(header, dict):
        raise BadBlockFile(f"has a header that is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict):
        raise BadBlockFile(f"has metadata that is a JSON {type(meta).__name__}, not an object")
    return header, meta


def decode(data: bytes, model_id: str, chain_hash: bytes, token_ids: Sequence[int], layout) -> list[np.ndarray]:
    """The K/V arrays of a block file, after checking that it is the block ``chain_hash`` of ``model_id``.

    ``token_ids`` are the block's tokens; ``layout`` is the name, shape and dtype of
    each array a block holds, in ``read_blocks`` order. The arrays are views of ``data``.
    """
    length = header_length(data[:8], len(data))
    tensors, meta = parse_header(data[8 : 8 + length])
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        found = f"{meta.get('format')!r} version {meta.get('version')!r}"
        raise BadBlockFile(f"has format {found}, not {FORMAT!r} version {VERSION!r}")
    if meta.get("model_id") != model_id:
        raise BadBlockFile(f"belongs to another model ({meta.get('model_id')!r})")
    if meta.get("chain_hash") != chain_hash.hex():
        raise BadBlockFile("holds another block than its name says")
    expected = {"token_ids": ((len(token_ids),), np.dtype("int64"))}
    for name, shape, dtype in layout:
        expected[name] = (tuple(shape), storage_dtype(dtype))
    if sorted(tensors) != sorted(expected):
        raise BadBlockFile(f"has tensors {sorted(tensors)}, not the {sorted(expected)} this model's K/V needs")
    buffer = memoryview(data)[8 + length :]
    arrays = {name: _tensor(name, tensors[name], buffer, *expected[name]) for name in expected}
    if arrays["token_ids"].tolist() != list(token_ids):
        raise BadBlockFile("holds other tokens than the prompt")
    kv = [arrays[name] for name, _, _ in layout]
    if checksum(arrays["token_ids"], kv) != meta.get("checksum"):
        raise BadBlockFile("fails its checksum (corrupt)")
    return kv


def _tensor(name: str, entry, buffer: memoryview, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """The array a header entry describes, if it has the expected shape and dtype and lies inside the data."""
    if not isinstance(entry, dict):
        raise BadBlockFile(f"describes {name} with a JSON {type(entry).__name__}, not an object")
    if entry.get("dtype") != _DTYPE_NAMES.get(dtype) or entry.get("shape") != list(shape):
        found = f"{entry.get('dtype')} {entry.get('shape')}"
        raise BadBlockFile(f"has {name} of {found}, not {_DTYPE_NAMES.get(dtype, dtype)} {list(shape)}")
    count = math.prod(shape)
    offsets = entry.get("data_offsets")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(offset) is int for offset in offsets)
        and 0 <= offsets[0]
        and offsets[1] - offsets[0] == count * dtype.itemsize
        and offsets[1] <= len(buffer)
    ):
        raise BadBlockFile(f"has {name} at offsets {offsets!r}, outside its data (corrupt or truncated)")
    return np.frombuffer(buffer, dtype, count=count, offset=offsets[0]).reshape(shape)
