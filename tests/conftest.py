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


@pytest.fixture(params=["read first", "launched ahead"])
def decode_launch(request, monkeypatch):
    """Both ways steady decoding launches a step built ahead: after reading the step in flight (scatter
    writes), or before (where K/V writes are in place, as on CUDA; here over scatters, which copy a pool
    that a step in flight holds but give the same values)."""
    from llm_paged_mlx.engine.runner import ModelRunner

    if request.param == "launched ahead":
        monkeypatch.setattr(ModelRunner, "writes_in_place", property(lambda self: True))
    return request.param
