"""The OpenAI-compatible server: ``llm paged-mlx serve MODEL`` (or ``python -m llm_paged_mlx serve MODEL``)."""

import asyncio
import gc
import signal
import sys

import uvicorn

from ..engine.loop import EngineLoop, exit_at_once, freeze_heap
from .app import ServedModel, create_app

__all__ = ["ServedModel", "create_app", "freeze_heap", "run"]

GIL_SWITCH_INTERVAL_S = 0.0005


def run(served: ServedModel, host: str, port: int, api_key=None, max_body_bytes: int = 32 * 1024**2) -> None:
    """Serve until Ctrl-C or SIGTERM: then every request ends, open streams close, and this returns.

    The engine loop is stopped at once (its streams end with a 503 error event) and
    waited for at exit, at most ``loop.EXIT_WAIT_S``; the process exits with 0 whether
    the step running ended by then or not: it stopped as asked (a service manager takes
    another status for a failure). A second Ctrl-C or SIGTERM, until the process has
    ended, ends it at once with 128 + the signal's number.
    """
    app = create_app(served, api_key=api_key, max_body_bytes=max_body_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    frozen = freeze_heap()
    # uvicorn puts back the handlers it replaced once it has shut down, then raises the signal it caught again.
    after = _InterruptOnce()
    previous = {signum: signal.signal(signum, after) for signum in (signal.SIGINT, signal.SIGTERM)}
    # The event loop's thread and the engine loop's take turns at the GIL; by default a thread that waits for it
    # gets it after 5 ms, which the engine loop, waking from the device every step, would wait at each step.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        _Server(config, served.loop).run()
    except KeyboardInterrupt:  # the exit signal, raised again once uvicorn has shut down
        served.loop.exit_status_past_wait = 0
        previous = dict.fromkeys(previous, exit_at_once)  # a second signal, until the process has ended
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.setswitchinterval(switch_interval)
        if frozen:
            gc.unfreeze()


class _InterruptOnce:
    """The SIGINT and SIGTERM handler while the server runs, under uvicorn's: its first call (uvicorn raising
    the exit signal it caught again) ends ``run`` with KeyboardInterrupt rather than the process with 143;
    a signal after that (the user's second, while asyncio shuts down) ends the process at once."""

    def __init__(self):
        self.called = False

    def __call__(self, signum, frame):
        if self.called:
            exit_at_once(signum, frame)
        self.called = True
        raise KeyboardInterrupt


class _Server(uvicorn.Server):
    """uvicorn's server, whose exit signal also begins to stop the engine loop, so that open streams end at once;
    a second signal ends the process."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop):
        super().__init__(config)
        self.loop = loop

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        for second in (signal.SIGINT, signal.SIGTERM):  # uvicorn puts back the handlers it replaced when it ends
            signal.signal(second, exit_at_once)
        # The handler may have interrupted this thread inside the engine loop's lock (in ``submit``): the stop,
        # which takes that lock, begins once the handler has returned.
        asyncio.get_running_loop().call_soon_threadsafe(self.loop.request_stop)
