"""Set-up for the whole test session."""

import signal

import pytest


def pytest_configure(config):
    # A shell without job control starts `cmd &` with SIGINT ignored, and an ignored SIGINT stays
    # ignored in every process started from there: the tests of Ctrl-C (raise_signal here, SIGINT
    # sent to `llm`) would then see nothing happen. A handler, unlike SIG_IGN, is reset by exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def kv_bits_schedule_free(monkeypatch):
    """Quantized K/V as ``mx.quantize`` gives them, every key read from the pool (``PagedLayerCache``'s two
    faithfulness settings off), so that an engine's tokens do not depend on where its steps cut a prompt or
    on how many rows they hold: for tests that compare schedules (a tight pool against a roomy one) with
    ``kv_bits``."""
    from llm_paged_mlx.models.paged_cache import PagedLayerCache

    monkeypatch.setattr(PagedLayerCache, "prompts_attend_unquantized", False)
    monkeypatch.setattr(PagedLayerCache, "rotates_quantized_rows", False)


@pytest.fixture
def kv_read_from_pool(monkeypatch):
    """Quantized K/V stored as the engine stores them (keys rotated), but every key read from the pool, a
    prompt's own too: so that the tokens after a prompt read back from the disk tier are those after the
    same prompt computed."""
    from llm_paged_mlx.models.paged_cache import PagedLayerCache

    monkeypatch.setattr(PagedLayerCache, "prompts_attend_unquantized", False)


@pytest.fixture(params=["read first", "launched ahead", "kernel writes"])
def decode_launch(request, monkeypatch):
    """The ways steady decoding launches a step built ahead: after reading the step in flight (where K/V
    writes would copy a pool that step holds: a GPU's scatters), or before (where they are in place: MLX's
    scatters on this CPU, CUDA's kernel); "kernel writes": before, where the attention kernel takes the step's
    K/V rows itself (``write_and_attend``, as CUDA's; here a scatter into the arrays it is given, which is
    what writing in place means for their values) and says so, MLX's scatters aside."""
    from llm_paged_mlx.engine.runner import ModelRunner
    from llm_paged_mlx.kernels.portable import PortableKernel

    def write_and_attend(self, queries, k_flat, v_flat, index, keys, values, plan, shape, scale, **masking):
        k_flat[index] = keys
        v_flat[index] = values
        return self(queries, k_flat.reshape(*shape, -1), v_flat.reshape(*shape, -1), plan, scale, **masking)

    if request.param == "read first":
        monkeypatch.setattr(ModelRunner, "writes_in_place", property(lambda self: False))
    elif request.param == "launched ahead":
        monkeypatch.setattr(ModelRunner, "writes_in_place", property(lambda self: True))
    elif request.param == "kernel writes":
        monkeypatch.setattr(ModelRunner, "scatters_in_place", property(lambda self: False))
        monkeypatch.setattr(PortableKernel, "in_place_writes", True, raising=False)
        monkeypatch.setattr(PortableKernel, "write_and_attend", write_and_attend, raising=False)
    return request.param
