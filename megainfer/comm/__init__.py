"""M2N / N2M communication layer: point-to-point dispatch and combine between the attention
and expert pools, over MPI (CPU), NCCL (GPU) or an in-process loopback. See docs/comm.md."""
from megainfer.comm.channel import Channel
from megainfer.comm.slot import Header, Message, Outgoing, RecvHandle, SendHandle
from megainfer.comm.errors import (CommError, CommProtocolError, CommTimeoutError,
                                   MessageTooLargeError)
from megainfer.comm.loopback import LoopbackFabric, LoopbackTransport
from megainfer.comm.m2n import M2N, combine_spec, dispatch_spec, make_transports, wait_all
from megainfer.comm.spec import (KIND_DATA, KIND_REBALANCE, KIND_STOP, Field, MessageSpec)
from megainfer.comm.transport import Buffer, TransportRequest, Transport
from megainfer.comm.wait import WaitPolicy

__all__ = ["Channel", "Header", "Message", "Outgoing", "RecvHandle", "SendHandle", "CommError",
           "CommProtocolError", "CommTimeoutError", "MessageTooLargeError", "LoopbackFabric",
           "LoopbackTransport", "M2N", "combine_spec", "dispatch_spec", "make_transports",
           "wait_all", "KIND_DATA", "KIND_REBALANCE", "KIND_STOP", "Field", "MessageSpec",
           "Buffer", "TransportRequest", "Transport", "WaitPolicy"]
