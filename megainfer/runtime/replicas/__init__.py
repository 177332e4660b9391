"""The attention replicas' lockstep loop and rank 0's hand-out of requests to them
(``scheduler.routing``)."""
from megainfer.runtime.replicas.loop import ReplicaLoop
from megainfer.runtime.replicas.request_router import ReplicaView, Router, prompt_tokens_of

__all__ = ["ReplicaLoop", "ReplicaView", "Router", "prompt_tokens_of"]
