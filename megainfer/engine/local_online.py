"""What an ``EngineCore`` reads of an engine that runs in this process alone (single mode's
``LLMEngine``): its queues from its scheduler and block pool, and the answers of a process that
no rank watches, holds nothing before its queue, has no pipeline spans, never re-plans
and offloads no decode attention (``engine_core.core.OnlineEngine``; the runtime's rank 0
answers otherwise)."""
from __future__ import annotations

from .stats import EngineLoad


class LocalOnline:
    """A mixin: needs ``scheduler``, ``blocks`` and ``model_config``."""

    idle_interval_s = None  # one process: nothing watches it between iterations
    stream_tokens = True  # (every step's tokens are at hand here: nothing to switch off)
    stall_allowance_s = 0.0

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def load(self) -> EngineLoad:
        sched, blocks = self.scheduler, self.blocks
        return EngineLoad(len(sched.running), sched.num_waiting,
                          1.0 - blocks.num_free_blocks / max(1, blocks.num_blocks))

    def held_s(self, request_id) -> float:
        return 0.0  # its queue time is all of it

    def take_spans(self):
        return None

    def replan_switches(self) -> list:
        return []

    def order_replan(self, label: str, reason: str) -> None:
        raise RuntimeError(f"re-plan order {label!r}: single mode does not re-plan")

    def offload_report(self):
        return None

    def hang_after_s(self, timeout_s: float) -> float:
        return timeout_s

    def idle_tick(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass
