"""The Metal and CUDA kernels are one algorithm rendered through two thin dialects."""

import re
import shutil
import subprocess

import mlx.core as mx
import pytest

from llm_paged_mlx.kernels import quantized_matvec
from llm_paged_mlx.kernels.dialect import (
    CUDA,
    DIALECTS,
    LATENT_TEMPLATE,
    METAL,
    TEMPLATE,
    WRITE_TEMPLATE,
    KernelSource,
    read_template,
    render,
    split_kernels,
)
from llm_paged_mlx.kernels.fused import REGISTER_FILE, CudaKernel, MetalKernel, kernel_sources
from llm_paged_mlx.kernels.fused_check import check_error
from llm_paged_mlx.kernels.latent import latent_source
from llm_paged_mlx.kernels.quantized import QuantizedPool

VARIANTS = [(None, None)] + [(bits, group) for bits in (8, 4) for group in (32, 64, 128)]
QUANTIZED_POOLS = ["k_pool", "k_scales", "k_biases", "v_pool", "v_scales", "v_biases"]

# Words that belong to one language: the template must leave them to the dialects.
DIALECT_WORDS = r"__shared__|__syncthreads|__shfl|threadIdx|blockIdx|threadgroup|simd_|device|constant|\buint\b"


def strip_dialect(body: str, dialect) -> str:
    assert body.startswith(dialect.prelude)
    return body[len(dialect.prelude) :]


@pytest.mark.parametrize(
    "name,tiles,names",
    [
        (TEMPLATE, False, {"partition", "reduce"}),
        (LATENT_TEMPLATE, True, {"partition"}),
        (WRITE_TEMPLATE, False, {"write_rows"}),
    ],
)
def test_both_dialects_render_the_same_algorithm(name, tiles, names):
    template = read_template(name)
    kernels = split_kernels(template)
    assert set(kernels) == names
    metal, cuda = render(template, METAL, tiles=tiles), render(template, CUDA, tiles=tiles)
    for name, algorithm in kernels.items():
        metal_body = strip_dialect(metal[name][1], METAL)
        cuda_body = strip_dialect(cuda[name][1], CUDA)
        assert metal_body == cuda_body == algorithm
        assert metal[name][1] != cuda[name][1]  # the dialects do differ
        assert (METAL.tiles in metal[name][0]) == (CUDA.tiles in cuda[name][0]) == tiles
        assert (f"#define PA_TILE {METAL.tile}\n" in metal[name][0]) == tiles


@pytest.mark.parametrize("name", [TEMPLATE, LATENT_TEMPLATE, WRITE_TEMPLATE])
def test_template_code_has_no_language_specific_words(name):
    for kernel, body in split_kernels(read_template(name)).items():
        code = re.sub(r"//.*", "", body)
        assert not re.search(DIALECT_WORDS, code), (kernel, re.search(DIALECT_WORDS, code))


def test_dialects_define_the_names_templates_use():
    def names(dialect):  # beside these, each dialect has helpers of its own (pa_pair, PA_MMA8, ...)
        text = dialect.header + dialect.tiles + dialect.prelude
        return set(re.findall(r"#define (PA_\w+)", text)) | set(re.findall(r"\b(pa_\w+|Pa[A-Z]\w*)\b", text)) | {"PA_TILE"}

    header = kernel_sources(read_template(), CUDA, 4, 64)["partition"].header
    variant = set(re.findall(r"#define (PA_\w+)", header)) - names(CUDA)
    assert variant == {"PA_BITS", "PA_GROUP", "PA_NEW", "PA_ROPE"}
    for name in (TEMPLATE, LATENT_TEMPLATE, WRITE_TEMPLATE):
        used = set(re.findall(r"\b(PA_\w+|pa_\w+|Pa[A-Z]\w*)\b", "".join(split_kernels(read_template(name)).values())))
        assert used <= (names(CUDA) & names(METAL)) | variant
    assert set(DIALECTS) == {"cuda", "metal"}


def test_latent_kernel_is_named_by_its_template_and_reads_every_input():
    template = read_template(LATENT_TEMPLATE)
    for dialect in (CUDA, METAL):
        source = latent_source(template, dialect)
        assert source.name == latent_source(template, dialect).name != latent_source(template + " ", dialect).name
        for name in source.input_names + source.output_names:
            assert re.search(rf"\b{name}\b", source.source), name


def test_latent_kernel_supports_what_its_tiles_and_threadgroup_memory_allow():
    cuda, metal = CudaKernel().latent, MetalKernel().latent

    def pool(row=576, block=16, dtype=mx.bfloat16, kv_heads=1):
        return mx.zeros((3, kv_heads, block, row), dtype)

    for kernel in (cuda, metal):
        assert kernel.supports(mx.bfloat16, pool(), 128, 512)  # DeepSeek-V3
        assert kernel.supports(mx.float16, pool(dtype=mx.float16), 16, 512)  # V2-Lite
        assert kernel.supports(mx.bfloat16, pool(288), 16, 256)  # MiniCPM3
        assert kernel.shared_bytes(mx.bfloat16, 576, 512, 16) <= kernel.dialect.shared_memory
        assert not kernel.supports(mx.float32, pool(dtype=mx.float32), 128, 512)  # no float32 tiles
        assert not kernel.supports(mx.float16, pool(), 128, 512)  # queries and pool alike
        assert not kernel.supports(mx.bfloat16, pool(kv_heads=2), 128, 512)
        assert not kernel.supports(mx.bfloat16, pool(), 4, 512)  # fewer heads than a tile
        assert not kernel.supports(mx.bfloat16, pool(), 128, 2048)  # more values than the reduce's threads
        assert not kernel.supports(mx.bfloat16, pool(block=4), 128, 512)
        assert not kernel.supports(mx.bfloat16, quantized(8, 64, (3, 1, 16, 576)), 128, 512)
    assert not cuda.supports(mx.bfloat16, pool(), 8, 512) and metal.supports(mx.bfloat16, pool(), 8, 512)
    assert not cuda.supports(mx.bfloat16, pool(block=8), 128, 512) and metal.supports(mx.bfloat16, pool(block=8), 128, 512)


@pytest.mark.parametrize("dialect", [CUDA, METAL], ids=["cuda", "metal"])
def test_variants_render_one_algorithm_with_their_own_names_inputs_and_macros(dialect):
    template = read_template()
    algorithm = split_kernels(template)
    variants = [(bits, group, False, False) for bits, group in VARIANTS] + [(None, None, True, False)]
    variants.append((None, None, True, True))
    sources = {v: kernel_sources(template, dialect, *v) for v in variants}
    names = [s["partition"].name for s in sources.values()]
    assert len(set(names)) == len(names)  # MLX caches kernels by name
    assert len({s["reduce"].name for s in sources.values()}) == 1  # the reduce pass is the same for all
    for (bits, group, new, rope), kernels in sources.items():
        partition = kernels["partition"]
        assert partition.source == dialect.prelude + algorithm["partition"]
        macros = f"#define PA_BITS {bits or 0}\n#define PA_GROUP {group or 0}\n#define PA_NEW {int(new)}\n"
        assert partition.header.startswith(macros + f"#define PA_ROPE {int(rope)}\n")
        assert partition.header.endswith(dialect.header)
        pools = QUANTIZED_POOLS if bits else ["k_pool", "v_pool"] + (["new_k", "new_v"] if new else [])
        pools += ["rope"] if rope else []
        tail = ["block_tables", "context_lens", "table_starts", "sinks", "params"]
        assert partition.input_names == ["queries", *pools, *tail]
        assert partition.output_names == ["part_out", "part_m", "part_l"]
        if bits:
            assert f"_q{bits}g{group}_" in partition.name
        assert ("_new_" in partition.name) == new
        assert ("_rope_" in partition.name) == rope
        for name in partition.input_names:  # every input is read by the body
            assert re.search(rf"\b{name}\b", partition.source), name


def quantized(bits, group_size, shape=(3, 8, 16, 128), dtype=mx.bfloat16):
    data, scales, biases = mx.quantize(mx.zeros(shape, dtype), group_size, bits)
    return QuantizedPool(data, scales, biases, bits, group_size)


def test_fused_kernel_supports_the_quantized_pools_it_renders():
    kernel = CudaKernel()
    assert CudaKernel.quantized and MetalKernel.quantized
    for bits in (8, 4):
        for group in (32, 64, 128):
            pool = quantized(bits, group)
            assert pool.shape == (3, 8, 16, 128)
            assert kernel.supports(mx.bfloat16, pool, quantized(bits, group), 32)
            assert not kernel.supports(mx.float16, pool, pool, 32)  # dtype is the scales'
    plain = mx.zeros((3, 8, 16, 128), mx.bfloat16)
    assert kernel.supports(mx.bfloat16, plain, plain, 32)
    assert not kernel.supports(mx.bfloat16, quantized(4, 64), plain, 32)  # K and V alike, or not at all
    assert not kernel.supports(mx.bfloat16, quantized(4, 64), quantized(8, 64), 32)
    assert not kernel.supports(mx.bfloat16, quantized(4, 64), quantized(4, 32), 32)
    assert not kernel.supports(mx.bfloat16, quantized(2, 64), quantized(2, 64), 32)  # 2 bits: not written for
    assert not kernel.supports(mx.bfloat16, quantized(4, 32, (3, 8, 16, 96)), quantized(4, 32, (3, 8, 16, 96)), 32)


def test_fused_kernel_splits_few_rows_over_more_simd_groups_within_registers_and_threadgroup_memory():
    cuda, metal = CudaKernel(), MetalKernel()
    assert cuda.warp_choices(1) == cuda.warp_choices(4) == [4, 8, 16] and metal.warp_choices(4) == [4]
    assert cuda.warp_choices(5) == cuda.warp_choices(8) == [4, 8]  # 16 of them: more registers than an SM has
    assert CudaKernel(warps=8).warp_choices(4) == [8]
    # threadgroups = rows x KV heads x head groups x partitions; the grid keeps at most 2048 simd groups
    assert cuda._warps(8, 4) == cuda._warps(128, 4) == 16  # 1 and 16 rows of 8 KV heads
    assert cuda._warps(256, 4) == 8 and cuda._warps(512, 4) == cuda._warps(10**6, 4) == 4
    assert cuda._warps(8, 8) == 8 and metal._warps(8, 4) == 4 and CudaKernel(warps=8)._warps(10**6, 4) == 8
    for kernel in (cuda,):
        for heads, dim, block in ((1, 64, 16), (4, 128, 16), (8, 128, 32), (8, 256, 16)):
            for warps in kernel.warp_choices(heads):
                slots = kernel._slots(warps, heads, dim, block)
                assert 1 <= slots <= warps
                assert kernel.shared_bytes(heads, dim, block, slots) <= kernel.dialect.shared_memory
                more = kernel.shared_bytes(heads, dim, block, slots + 1)
                assert slots == warps or more > kernel.dialect.shared_memory
    assert cuda._slots(16, 4, 128, 16) == 16  # Llama-8B: every simd group's sums at once
    assert cuda._slots(8, 8, 256, 16) == 3
    assert metal._slots(4, 4, 128, 16) == metal._slots(4, 1, 64, 16) == 1  # one at a time, as before


CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float"}


def cuda_source(kernel, params: dict, constants: dict) -> str:
    """A kernel's source wrapped as mx.fast.cuda_kernel wraps it: its header, then a function whose
    parameters are the inputs (with ``NAME_shape`` and ``NAME_strides`` where the body mentions them) and
    outputs, in order, and whose body declares the template values before the kernel's source."""
    args = []
    for name in kernel.input_names + kernel.output_names:
        const = "const " if name in kernel.input_names else ""
        args.append(f"{const}{params[name]}* {name}")
        for info, kind in (("shape", "Shape"), ("strides", "Strides")):
            if name in kernel.input_names and f"{name}_{info}" in kernel.source:
                args.append(f"const __grid_constant__ {kind} {name}_{info}")
    values = "".join(
        f"using {k} = {CUDA_TYPES[v]};\n"
        if isinstance(v, mx.Dtype)
        else f"constexpr {type(v).__name__} {k} = {str(v).lower()};\n"
        for k, v in constants.items()
    )
    return f"__global__ void {kernel.name}({', '.join(args)}) {{\n{values}{kernel.source}}}\n"


# What mx.fast.cuda_kernel's own header gives a kernel, as far as ours use it.
CUDA_PREAMBLE = (
    "#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
    "struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };\n"
    "struct Strides { int64_t d[8]; __device__ int64_t operator[](int i) const { return d[i]; } };\n"
)


def compile_with_nvcc(tmp_path, sources: list[str], *flags: str) -> list[str]:
    """nvcc's output for each source, compiled for sm_90 side by side; each must compile without a warning."""
    jobs = []
    for i, source in enumerate(sources):
        (tmp_path / f"k{i}.cu").write_text(source)
        command = ["nvcc", "-arch=sm_90", *flags, "-c", f"k{i}.cu", "-o", f"k{i}.o"]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        jobs.append(subprocess.Popen(command, cwd=tmp_path, **pipes))
    outputs = [job.communicate(timeout=300)[0] for job in jobs]
    for job, output in zip(jobs, outputs):
        assert job.returncode == 0 and "warning" not in output, output
    return outputs


def fused_cuda_source(bits, group, dtype, dim, block, rep, hpg, one, window, sinks, softcap, warps, slots,
                      new=False, rotation=None) -> str:
    """The partition and reduce kernels of one variant, wrapped as mx.fast.cuda_kernel wraps them;
    ``rotation``: ``(ROT, TRAD)`` of a variant that rotates its queries and own keys."""
    kernels = kernel_sources(read_template(), CUDA, bits, group, new, rotation is not None)
    ctype = CUDA_TYPES[dtype]
    names = ["queries", "k_pool", "v_pool", "k_scales", "k_biases", "v_scales", "v_biases", "new_k", "new_v"]
    params = dict.fromkeys(names, ctype)
    if bits:
        params["k_pool"] = params["v_pool"] = "uint32_t"
    params.update(block_tables="int32_t", context_lens="int32_t", table_starts="int32_t", sinks=ctype)
    params.update(params="float", part_m="float", part_l="float", rope="float")
    masking = dict(WINDOW=window, SINKS=sinks, SOFTCAP=softcap)
    constants = dict(T=dtype, D=dim, BS=block, REP=rep, HPG=hpg, PART=512, NW=warps, SLOTS=slots, ONE=one, **masking)
    if rotation is not None:
        constants.update(ROT=rotation[0], TRAD=rotation[1])
    return (
        CUDA_PREAMBLE
        + kernels["partition"].header
        + cuda_source(kernels["partition"], {**params, "part_out": ctype if one else "float"}, constants)
        + cuda_source(kernels["reduce"], {**params, "part_out": "float", "out": ctype}, dict(T=dtype, D=dim, PART=512,
                                                                                               **masking))
    )


@pytest.mark.parametrize("bits,new,rope", [(None, False, False), (None, True, False), (4, False, False),
                                           (None, True, True)])  # fmt: skip
def test_the_partition_kernel_reads_every_input_but_the_pools_and_params_through_its_strides(bits, new, rope):
    """It is built to take inputs as they are (``FusedKernel.decode``: views are not copied), so an input it
    indexes as row-contiguous must be one the engine makes so: the pools, the params and the rope's table
    (``AttentionPlan.rope_table``), no other."""
    partition = kernel_sources(read_template(), CUDA, bits, 64 if bits else None, new, rope)["partition"]
    strided = {name for name in partition.input_names if f"{name}_strides" in partition.source}
    pools = {name for name in partition.input_names if name.startswith(("k_", "v_"))}
    assert strided == set(partition.input_names) - pools - {"params", "rope"}

    assert {"queries", "block_tables", "context_lens"} <= strided and ({"new_k", "new_v"} <= strided) == new


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_rendering_compiles_with_nvcc(tmp_path):
    """Wraps each variant's CUDA rendering the way mx.fast.cuda_kernel does and compiles it for sm_90.

    With ONE (a single partition per row) the partition kernel writes T outputs."""
    cases = [
        # bits, group, dtype, D, BS, REP, HPG, ONE, WINDOW, SINKS, SOFTCAP, NW, SLOTS
        (None, None, mx.bfloat16, 128, 16, 4, 4, False, 0, False, False, 4, 4),
        (None, None, mx.bfloat16, 128, 16, 4, 4, True, 0, False, False, 16, 16),
        (None, None, mx.float32, 64, 32, 1, 1, True, 0, False, False, 8, 8),
        (4, 64, mx.bfloat16, 128, 16, 4, 4, False, 0, False, False, 16, 16),
        (8, 32, mx.float16, 256, 32, 8, 8, True, 0, False, False, 8, 3),
        (None, None, mx.bfloat16, 64, 16, 8, 8, True, 128, True, False, 4, 4),
        (4, 64, mx.bfloat16, 128, 16, 2, 2, False, 4096, True, True, 8, 8),
        # ... and NEW, the rotation (ROT, TRAD): RoPE in the kernel, partial and traditional alike
        (None, None, mx.bfloat16, 128, 16, 4, 4, False, 0, False, False, 16, 16, True, (128, False)),
        (None, None, mx.float16, 64, 16, 8, 8, True, 128, True, True, 4, 4, True, (32, True)),
    ]
    sources = [fused_cuda_source(*case) for case in cases]
    # 177: a variable declared and never used (the prelude's pa_group_x in the reduce kernel)
    compile_with_nvcc(tmp_path, sources, "-diag-suppress", "177")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_most_simd_groups_chosen_fit_an_sm_s_registers(tmp_path):
    """For the heads a group takes, the most simd groups ``warp_choices`` allows launch: the partition
    kernel's registers (ptxas, rounded up to 8 a thread) times its threads fit ``REGISTER_FILE``. The
    variants that take the most registers at each count of heads (every variant was compiled once)."""
    kernel = CudaKernel()
    cases = [  # bits, group, dtype, D, BS, HPG, new (or "rope": and rotated), window with sinks and softcap
        (None, None, mx.float32, 256, 16, 5, True, False),
        (None, None, mx.float32, 256, 16, 5, "rope", True),
        (None, None, mx.bfloat16, 256, 16, 6, "rope", False),
        (None, None, mx.bfloat16, 128, 16, 4, "rope", False),
        (None, None, mx.bfloat16, 256, 16, 4, False, False),
        (None, None, mx.bfloat16, 256, 16, 6, True, False),
        (4, 64, mx.bfloat16, 256, 16, 8, False, False),
        (4, 64, mx.float32, 128, 32, 4, False, True),
        (8, 32, mx.float32, 128, 32, 5, False, True),
        (None, None, mx.float32, 128, 16, 5, True, False),
    ]
    sources, threads = [], []
    for bits, group, dtype, dim, block, hpg, new, masked in cases:
        warps = max(kernel.warp_choices(hpg))
        slots = kernel._slots(warps, hpg, dim, block)
        rotation = (dim, False) if new == "rope" else None
        sources.append(fused_cuda_source(bits, group, dtype, dim, block, hpg, hpg, False, 4096 if masked else 0,
                                         masked, masked, warps, slots, bool(new), rotation))  # fmt: skip
        threads.append(warps * 32)
    outputs = compile_with_nvcc(tmp_path, sources, "-diag-suppress", "177", "-Xptxas", "-v")
    for case, output, count in zip(cases, outputs, threads):
        properties = r"Function properties for \w*partition\w*\n.*?Used (\d+) registers"
        used = int(re.search(properties, output, re.S)[1])
        assert -(-used // 8) * 8 * count <= REGISTER_FILE, (case, used, count)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_lane_stages_a_whole_block_only_for_few_heads_a_group(tmp_path):
    """A lane keeps a whole block's K loads (eight 16-byte steps, bf16, D=128) only where it serves at most 4
    query heads: at 5 to 8 heads a group the decode step's variant (RoPE in the kernel) stays within 128
    registers a thread, so that two threadgroups of 8 simd groups still share an SM."""
    kernel = CudaKernel()
    sources = []
    for hpg in (5, 8):
        warps = max(kernel.warp_choices(hpg))
        slots = kernel._slots(warps, hpg, 128, 16)
        sources.append(fused_cuda_source(None, None, mx.bfloat16, 128, 16, hpg, hpg, False, 0, False, False, warps,
                                         slots, True, (128, False)))  # fmt: skip
    outputs = compile_with_nvcc(tmp_path, sources, "-diag-suppress", "177", "-Xptxas", "-v")
    for output in outputs:
        used = int(re.search(r"Function properties for \w*partition\w*\n.*?Used (\d+) registers", output, re.S)[1])
        assert used <= 128, used


def partition_ptx(tmp_path, new: bool, rotation) -> str:
    """The PTX of the partition kernel, from its entry on (bf16, D=128, 4 heads a group, 16 simd groups)."""
    source = fused_cuda_source(None, None, mx.bfloat16, 128, 16, 4, 4, True, 0, False, False, 16, 16, new, rotation)
    (tmp_path / "k.cu").write_text(source)
    subprocess.run(["nvcc", "-arch=sm_90", "-diag-suppress", "177", "-ptx", "k.cu", "-o", "k.ptx"], cwd=tmp_path,
                   check=True, capture_output=True)  # fmt: skip
    ptx = (tmp_path / "k.ptx").read_text()
    return ptx[re.search(r"\.entry \w*paged_attention_partition", ptx).start() :]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("new,rotation", [(True, None), (False, None), (True, (128, False))],
                         ids=["new", "pooled", "rope"])  # fmt: skip
def test_a_simd_group_issues_its_key_loads_together(tmp_path, new, rotation):
    """In a decode step's variant (the row's own K/V given) and in the one that reads the pools alone, the
    partition kernel's K loads of a block (bf16, D=128: a lane's eight 16-byte loads, one a token step) come
    one after another in the PTX, with no use of a loaded value (a shuffle of its dot product) between them,
    so that a simd group waits on memory once for them, not once each; and with no branch (around the row's
    own token, ptxas would load from both sources)."""
    partition = partition_ptx(tmp_path, new, rotation)
    barrier = re.search(r"\b(bar|barrier)\.sync", partition).start()  # the block ids read (then the K loop)
    after_barrier = partition[barrier:]
    first_load = after_barrier.index("ld.global.v4")
    until_used = after_barrier[first_load : after_barrier.index("shfl.sync")]
    assert until_used.count("ld.global.v4") >= 8, until_used
    assert "bra" not in until_used, until_used


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_rotating_kernel_reads_its_own_k_v_back_only_after_a_barrier(tmp_path):
    """With RoPE, each threadgroup writes the row's own K (rotated) and V into the pools and its loops read
    them back from there: between its last write to the pools and its first K load there is a barrier
    (without one, a simd group could read the slot before another has written it)."""
    partition = partition_ptx(tmp_path, True, (128, False))
    first_load = partition.index("ld.global.v4")
    last_write = partition.rindex("st.global", 0, first_load)
    assert re.search(r"\b(bar|barrier)\.sync", partition[last_write:first_load])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_rendering_of_the_latent_kernel_compiles_with_nvcc(tmp_path):
    """The latent kernel, wrapped as mx.fast.cuda_kernel wraps it, compiles for sm_90 within the
    threadgroup memory ``supports`` allows, with no spills."""
    source = latent_source(read_template(LATENT_TEMPLATE), CUDA)
    jobs = []
    # DeepSeek; MiniCPM3; blocks that leave the block ids' array a few bytes long
    cases = [(mx.bfloat16, 576, 512, 16), (mx.float16, 288, 256, 32), (mx.bfloat16, 576, 512, 128),
             (mx.bfloat16, 576, 512, 256)]  # fmt: skip
    for i, (dtype, row, latent, block) in enumerate(cases):
        ctype = CUDA_TYPES[dtype]
        params = dict(queries=ctype, pool=ctype, block_tables="int32_t", context_lens="int32_t", params="float")
        params.update(part_out="float", part_m="float", part_l="float")
        constants = dict(T=dtype, D=row, DV=latent, BS=block, HM=CUDA.tile, PART=256, NW=4)
        (tmp_path / f"k{i}.cu").write_text(CUDA_PREAMBLE + source.header + cuda_source(source, params, constants))
        command = f"nvcc -arch=sm_90 -ptx k{i}.cu -o k{i}.ptx && nvcc -arch=sm_90 -Xptxas -v -c k{i}.cu -o k{i}.o"
        jobs.append(subprocess.Popen(command, shell=True, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True))  # fmt: skip
    kernel = CudaKernel().latent
    for i, ((dtype, row, latent, block), job) in enumerate(zip(cases, jobs)):
        output, _ = job.communicate(timeout=300)
        assert job.returncode == 0, output
        assert "warning" not in output, output
        assert "0 bytes spill stores" in output, output
        shared = int(re.search(r"(\d+) bytes smem", output).group(1))
        assert shared == kernel.shared_bytes(dtype, row, latent, block) <= CUDA.shared_memory
        staged = re.search(r"\.shared \.align (\d+) .*staged", (tmp_path / f"k{i}.ptx").read_text())
        assert staged and int(staged.group(1)) >= 16  # copied in 16-byte pieces


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal")
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("row,latent,block_size", [(576, 512, 16), (288, 256, 32)])
def test_metal_latent_kernel_compiles_and_matches_portable(dtype, row, latent, block_size):
    kernel = MetalKernel().latent
    with mx.stream(mx.gpu):
        error = kernel.check_error(dtype, row, latent, block_size)
    assert error <= {mx.float16: 5e-3, mx.bfloat16: 1e-2}[dtype]


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal")
@pytest.mark.parametrize("window,sinks,softcap", [(None, False, False), (128, True, False), (1024, False, True)])
@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("dim,block_size,rep", [(64, 16, 1), (128, 16, 4), (128, 32, 8), (256, 16, 2)])
def test_metal_kernel_compiles_and_matches_portable(dtype, dim, block_size, rep, bits, window, sinks, softcap):
    kernel = MetalKernel()
    with mx.stream(mx.gpu):
        masking = dict(window=window, sinks=sinks, softcap=softcap)
        error = check_error(kernel, dtype, dim, block_size, rep, bits=bits, group_size=64, **masking)
    assert error <= {mx.float32: 1e-4 if bits else 1e-5, mx.float16: 5e-3, mx.bfloat16: 1e-2}[dtype]


def test_only_the_cuda_kernels_write_k_v_in_place():
    """On Metal, MLX orders command buffers by the arrays kernels give, which a pool written in place is not:
    the Metal kernels leave the writes to MLX's scatter."""
    assert CudaKernel.in_place_writes and not MetalKernel.in_place_writes
    args = [None] * 8
    assert MetalKernel().write_and_attend(*args, scale=1.0) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_quantized_matvec_kernel_compiles_with_nvcc_without_spills(tmp_path):
    """csrc/quantized_matvec.cu (CUDA only), wrapped as mx.fast.cuda_kernel wraps it, for the rows the engine
    gives it and more, each dtype and both widths of code."""
    header, body = quantized_matvec.source()
    kernel = KernelSource("quantized_matvec", ["x", "w", "scales", "biases"], ["y"], header, body)
    sources = []
    for dtype, bits, group, rows in [(mx.bfloat16, 4, 64, 1), (mx.bfloat16, 4, 64, 2), (mx.float16, 8, 32, 5),
                                     (mx.float32, 4, 128, 8)]:  # fmt: skip
        ctype = CUDA_TYPES[dtype]
        params = dict(x=ctype, w="uint32_t", scales=ctype, biases=ctype, y=ctype)
        outputs = quantized_matvec.outputs_per_simd_group(rows)
        constants = dict(T=dtype, BITS=bits, GROUP=group, ROWS=rows, OUTS=outputs, NT=quantized_matvec.THREADS)
        sources.append(CUDA_PREAMBLE + header + cuda_source(kernel, params, constants))
    for output in compile_with_nvcc(tmp_path, sources, "-Xptxas", "-v"):
        assert "0 bytes spill stores" in output, output
