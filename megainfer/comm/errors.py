"""Typed errors of the M2N/N2M layer. Every message names the peer and the stream."""
from __future__ import annotations


class CommError(RuntimeError):
    """Base class: something went wrong moving a message between ranks."""


class CommTimeoutError(CommError):
    """A send or receive waited longer than ``WaitPolicy.timeout_s``.

    A ``RuntimeError`` (the peer is late or dead, the input was fine). Carries the peer rank,
    layer, micro-batch and iteration the caller was waiting for (``None`` when unknown).
    """

    def __init__(self, what: str, peer: int, layer, micro_batch, iteration, waited_s: float):
        self.peer, self.layer, self.micro_batch, self.iteration = peer, layer, micro_batch, iteration
        self.waited_s = waited_s
        super().__init__(f"{what} from/to peer rank {peer} timed out after {waited_s:.3f}s "
                         f"(layer={layer}, micro_batch={micro_batch}, iteration={iteration})")


class MessageTooLargeError(CommError, ValueError):
    """A message has more rows than the channel's capacity (never truncated)."""


class CommProtocolError(CommError):
    """A received header does not match what the receiver expected (wrong stream, bad magic)."""


class TransportChoiceError(CommError):
    """``comm.transport`` cannot work for these ranks; the message says which and why."""
