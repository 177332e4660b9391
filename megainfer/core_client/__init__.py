"""How a frontend (``LLM``, ``AsyncLLM``, the server) reaches an engine core in any deploy
mode: the prompts' intake in the frontend's process, and a ``CoreClient`` over the core
(``client.open_core``: a thread of this process, rank 0 of an ``mpiexec`` launch, or a child
job). docs/python_api.md."""
from megainfer.engine.resolve import JobTree

from .client import CoreClient, open_core
from megainfer.engine.failures import EngineDeadError, RankLostError
from .request_stream import Intake

__all__ = ["CoreClient", "JobTree", "open_core", "EngineDeadError", "RankLostError", "Intake"]
