"""Test helper: make a method or function raise on chosen calls, to fail engine steps at a given stage."""

import contextlib


class Fault(Exception):
    """The error an injected fault raises."""


class DeviceFault(RuntimeError):
    """An injected failure of the device while it runs a step."""


class Injector:
    """Wraps ``owner.name`` so that calls listed in ``fail_on`` (counted from 1) raise ``error``."""

    def __init__(self, monkeypatch, owner, name: str, fail_on=(), error=Fault):
        self.original = getattr(owner, name)
        self.calls = 0
        self.failures = 0
        self.fail_on = set(fail_on)
        self.error = error
        original = self.original

        def wrapper(*args, **kwargs):
            self.calls += 1
            if self.calls in self.fail_on:
                self.failures += 1
                raise self.error(f"{name} failed (call {self.calls})")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)


def run_through_faults(engine, prompts, params, expected_errors=(Fault,), max_failures=100):
    """Run prompts to the end, stepping again after each injected error; each request's token ids. ``params``:
    one for all, or a list."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    outputs = {i: [] for i in ids}
    failures = 0
    while engine.has_unfinished():
        try:
            chunks = engine.step()
        except expected_errors:
            failures += 1
            assert failures <= max_failures, "the engine keeps failing"
            continue
        for chunk in chunks:
            outputs[chunk.request_id] += chunk.token_ids
    with contextlib.suppress(*expected_errors):
        engine.step()  # reads whatever ran ahead for finished requests
    return [outputs[i] for i in ids]
