"""The test helper that launches ``kaisa-train`` under torchrun: which failures it retries."""

from __future__ import annotations

from tests.support.torchrun import _gloo_connect_abort

_ABORT = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    "  what():  [enforce fail at gloo/transport/tcp/address.cc:107] rv != -1. -1 vs -1. "
    "getpeername: Transport endpoint is not connected\n"
)
_PEER_LOST = (
    "[rank0]: Traceback (most recent call last):\n"
    "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:37270.\n"
)
_TORCHRUN = (
    "Traceback (most recent call last):\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    "  exitcode  : -6 (pid: 8374)  (SIGABRT)\n"
)


def test_a_gloo_connect_abort_alone_is_retried() -> None:
    assert _gloo_connect_abort(_ABORT + _PEER_LOST + _TORCHRUN)
    assert _gloo_connect_abort(_ABORT + _TORCHRUN)


def test_any_other_failure_is_not() -> None:
    kaisa_error = "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad\n"
    assert not _gloo_connect_abort(_PEER_LOST + _TORCHRUN)  # what aborted rank 1 is unknown
    assert not _gloo_connect_abort(_ABORT + kaisa_error + _PEER_LOST + _TORCHRUN)
    assert not _gloo_connect_abort("Segmentation fault\n" + _TORCHRUN)
