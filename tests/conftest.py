"""Set-up for the whole test session."""

import signal


def pytest_configure(config):
    # A shell without job control starts `cmd &` with SIGINT ignored, and an ignored SIGINT stays
    # ignored in every process started from there: the tests of Ctrl-C (raise_signal here, SIGINT
    # sent to `llm`) would then see nothing happen. A handler, unlike SIG_IGN, is reset by exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
