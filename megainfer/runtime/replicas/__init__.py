"""The attention replicas' lockstep loop and rank 0's hand-out of requests to them
(``scheduler.routing``)."""
from megainfer.runtime.replicas.loop import ReplicaLoop
from megainfer.runtime.replicas.request_router import (ReplicaView, RequestRouter, prompt_tokens_of,
                                                       tracks_keys)

__all__ = ["ReplicaLoop", "ReplicaView", "RequestRouter", "prompt_tokens_of", "tracks_keys"]
