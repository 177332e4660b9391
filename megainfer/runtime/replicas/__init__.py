"""The attention replicas' lockstep loop, rank 0's hand-out of requests to them
(``scheduler.routing``) and rank 0 as an online engine (``RuntimeEngine``)."""
from megainfer.runtime.replicas.loop import ReplicaLoop
from megainfer.runtime.runtime_engine import RuntimeEngine
from megainfer.runtime.replicas.request_router import (ReplicaView, RequestRouter, prompt_tokens_of,
                                                       tracks_keys)

__all__ = ["ReplicaLoop", "ReplicaView", "RequestRouter", "RuntimeEngine",
           "prompt_tokens_of", "tracks_keys"]
