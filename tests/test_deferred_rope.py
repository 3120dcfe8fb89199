"""RoPE left to the attention kernel (``models.deferred_rope``): which modules and layers defer, and the engine's
tokens with deferred RoPE, whoever rotates: the cache with the model's module, or a kernel."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, Llama3RoPE, SuScaledRoPE, YarnRoPE
from faults import Fault, Injector, run_through_faults
from models import tiny_model
from test_engine import random_prompts, reference, run_staggered

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.kernels.portable import PortableKernel
from llm_paged_mlx.models.paged_cache import PagedLayerCache
from llm_paged_mlx.models.adapt import check_model
from llm_paged_mlx.models.deferred_rope import DeferredRoPE, defer_rope, deferring, rope_spec, take

HEAD_DIM = 64
ROPES = {
    "plain": lambda: nn.RoPE(HEAD_DIM, base=10000),
    "traditional, positions scaled": lambda: nn.RoPE(HEAD_DIM, traditional=True, base=500000, scale=0.25),
    "partial": lambda: nn.RoPE(32, base=10000),
    "llama3": lambda: Llama3RoPE(HEAD_DIM, 131072, False, 500000,
                                 {"factor": 8.0, "original_max_position_embeddings": 8192}),
    "yarn": lambda: YarnRoPE(HEAD_DIM, scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.0),
    "longrope": lambda: SuScaledRoPE(HEAD_DIM, max_position_embeddings=131072,
                                     long_factor=[1.0 + i / 8 for i in range(32)]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ROPES))
def test_a_known_rope_module_s_numbers_rotate_as_it_does(name):
    module = ROPES[name]()
    spec = rope_spec(module, HEAD_DIM)
    assert spec is not None
    x = mx.random.normal((3, 4, 1, HEAD_DIM), key=mx.random.key(1))
    positions = mx.array([7, 1234, 4000], mx.int32)
    want = module(x, offset=positions)
    assert mx.abs(spec.rotate(x, positions) - want).max().item() <= 1e-4 * mx.abs(want).max().item()
    if name == "yarn":
        assert spec.value_scale > 1.0  # read from the module


def test_other_rope_modules_are_not_deferred():
    class Shifted(nn.RoPE):  # a subclass may rotate otherwise
        def __call__(self, x, offset=0):
            return super().__call__(x, offset=offset + 1)

    assert rope_spec(Shifted(HEAD_DIM), HEAD_DIM) is None
    assert rope_spec(DynamicNTKScalingRoPE(HEAD_DIM, 2048, False, 10000, 2.0), HEAD_DIM) is None
    assert rope_spec(nn.Identity(), HEAD_DIM) is None


class OddAttention(llama.Attention):
    """Llama's attention, but for what it does around its RoPE: ``query_factor`` multiplies the rotated queries,
    ``shift`` is added to the cache's offset, and ``values_are_keys`` writes the rotated keys as values too."""

    query_factor, shift, values_are_keys = None, 0, False

    def __call__(self, x, mask=None, cache=None):
        batch, length, _ = x.shape
        projections = ((self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads), (self.v_proj, self.n_kv_heads))
        queries, keys, values = (
            p(x).reshape(batch, length, heads, -1).transpose(0, 2, 1, 3) for p, heads in projections
        )
        offset = cache.offset + self.shift
        queries = self.rope(queries, offset=offset)
        queries = queries if self.query_factor is None else queries * self.query_factor
        keys = self.rope(keys, offset=offset)
        keys, values = cache.update_and_fetch(keys, keys if self.values_are_keys else values)
        out = llama.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def odd_model(**odd) -> nn.Module:
    """A tiny Llama whose first layer's attention is an ``OddAttention`` with ``odd`` set."""
    model = tiny_model("llama")
    for layer in model.model.layers:  # scores far apart, so that a query rotated wrongly changes tokens
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 16
    model.model.layers[0].self_attn.__class__ = type("Odd", (OddAttention,), odd)
    return model


def test_only_layers_that_hand_their_rotations_on_defer():
    model = odd_model(query_factor=1.0)  # what reaches attention is not what RoPE returned
    check_model(model)  # the attention hook the probe reads queries through
    assert defer_rope(model) == len(model.model.layers) - 1
    ropes = [layer.self_attn.rope for layer in model.model.layers]
    assert not isinstance(ropes[0], DeferredRoPE) and all(isinstance(r, DeferredRoPE) for r in ropes[1:])
    assert defer_rope(model) == 0  # once


def test_a_model_that_uses_a_rotated_array_twice_defers_none():
    """Its rotated keys are its values too: a deferred rotation would reach the keys alone."""
    model = odd_model(values_are_keys=True)
    check_model(model)
    assert defer_rope(model) == 0
    assert not any(isinstance(layer.self_attn.rope, DeferredRoPE) for layer in model.model.layers)


def test_a_rotation_no_cache_takes_is_an_error():
    rope = DeferredRoPE(nn.RoPE(HEAD_DIM), rope_spec(nn.RoPE(HEAD_DIM), HEAD_DIM))
    x = mx.ones((1, 1, 1, HEAD_DIM))
    assert not mx.array_equal(rope(x, offset=3), x)  # outside deferring(): rotated
    with pytest.raises(RuntimeError, match="RoPE was deferred but not applied in 1 places"):
        with deferring():
            assert rope(x, offset=3) is x
    with pytest.raises(KeyboardInterrupt):  # a step stopped mid-way leaves nothing deferred behind it
        with deferring():
            rope(x, offset=3)
            raise KeyboardInterrupt
    assert take(x) is None and not mx.array_equal(rope(x, offset=3), x)


def rotating_write_and_attend(declines: bool, calls: list):
    """A CPU stand-in for the CUDA kernel's ``write_and_attend``: decode rows rotated by the spec, written, then
    attended by the portable kernel; or, ``declines``, None for rows it would rotate."""

    def write_and_attend(self, queries, k_flat, v_flat, index, keys, values, plan, shape, scale, rope=None,
                         **masking):  # fmt: skip
        calls.append(rope)
        if rope is None or declines or not plan.one_token_per_sequence:
            return None
        k_flat[index] = rope.rotate(keys, plan.positions).astype(keys.dtype)
        v_flat[index] = values
        queries = rope.rotate(queries, plan.positions).astype(queries.dtype)
        return self(queries, k_flat.reshape(*shape, -1), v_flat.reshape(*shape, -1), plan, scale, **masking)

    return write_and_attend


@pytest.mark.parametrize("shift", [0, 3], ids=["at the positions", "at other offsets"])
@pytest.mark.parametrize("kernel", ["rotates nothing", "rotates", "declines"])
def test_deferred_rope_gives_mlx_lm_s_tokens(kernel, shift, monkeypatch):
    """Prompts in chunks and decode steps, compiled: whoever rotates, the engine's greedy tokens are mlx-lm's,
    and mlx-lm's own path through the deferred modules is unchanged. A layer that rotates at other offsets than
    the positions (``shift``) is rotated by its own module: a kernel rotates at the positions."""
    calls = []
    if kernel != "rotates nothing":
        monkeypatch.setattr(PortableKernel, "in_place_writes", True, raising=False)
        monkeypatch.setattr(PortableKernel, "applies_rope", True, raising=False)
        monkeypatch.setattr(PortableKernel, "write_and_attend", rotating_write_and_attend(kernel == "declines", calls),
                            raising=False)  # fmt: skip
    model = odd_model(shift=shift)
    prompts = random_prompts([3, 20, 40, 7, 18], seed=4)
    want = [reference(model, p, 10) for p in prompts]
    check_model(model)
    assert defer_rope(model) == len(model.model.layers)
    assert [reference(model, p, 10) for p in prompts] == want
    engine = Engine(model, num_blocks=64, max_num_batched_tokens=16)
    outputs = run_staggered(engine, prompts, SamplingParams(max_tokens=10), first=3, steps_between=2)
    assert outputs == want
    if kernel != "rotates nothing":  # decode steps offered the rotation to the kernel
        assert any(rope is not None for rope in calls)


@pytest.mark.parametrize("where", ["update_and_fetch", "attend"])
def test_a_step_that_fails_with_rotations_deferred_leaves_nothing_behind(where, monkeypatch):
    """A layer's cache raises after its RoPE deferred the rotations (before it takes the keys', or the queries'):
    the step is undone, no rotation is left for the next, and every request gets mlx-lm's tokens and frees its
    blocks."""
    monkeypatch.setattr(PortableKernel, "in_place_writes", True, raising=False)
    monkeypatch.setattr(PortableKernel, "applies_rope", True, raising=False)
    monkeypatch.setattr(PortableKernel, "write_and_attend", rotating_write_and_attend(False, []), raising=False)
    model = odd_model()
    prompts = random_prompts([40, 9, 25], seed=7)
    want = [reference(model, p, 10) for p in prompts]
    check_model(model)
    assert defer_rope(model) == len(model.model.layers)
    engine = Engine(model, num_blocks=64, compile_steps=False)  # eager: every step calls the caches
    injector = Injector(monkeypatch, PagedLayerCache, where, [3, 10, 17])
    assert run_through_faults(engine, prompts, SamplingParams(max_tokens=10), (Fault,)) == want
    assert injector.failures == 3
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
