"""Every control message between ranks, as a dataclass (the MPI tag each rides: ``tags.py``).
Tensors never travel here (they use ``megainfer.comm``): these are small Python objects sent
with mpi4py's object messages.

* Replicas' lockstep loop (``replicas/loop.py``, ``pd/loop.py``): ``ReplicaStatus`` (a leader's
  report after each step; with ``pd.offload`` its ``OffloadStatus``), ``Go`` (rank 0's answer
  to every attention rank, with the aborts).
* Live EPLB (``eplb/rebalancer.py``): ``PlacementUpdate``.
* PD (``pd/``): ``PrefillWork`` | ``PrefillStop`` to a prefill rank, ``PrefillReport`` of
  ``PrefillResult`` back; ``Expect``, ``Start``, ``Drop`` (and with ``pd.offload``
  ``OffloadHome``) in a ``Go`` to decode replicas; ``OffloadQKV`` / ``OffloadOut``,
  ``OffloadRelease``, ``OffloadReturn`` between decode and prefill ranks.
* Re-planning (``replan/``): ``ReplanOrder``, ``ExpertSamples``, ``GroupHeader`` of
  ``SampleMove``. docs/architecture.md, "Runtime rooms (`megainfer/runtime/`)"."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


# ---------------------------------------------------------------------- the replicas' loop
@dataclass
class ReplicaStatus:
    """A replica leader -> rank 0 after every step."""

    finished: list  # RequestOutputs finished (or aborted) in this step
    busy: bool  # the replica has work left (decoding, or with PD transfers still arriving)
    waiting: int
    running: int
    key_events: list = field(default_factory=list)  # prefix-cache (key, +-1) for cache-aware routing
    transfers_pending: int = 0  # PD: KV transfers announced to this replica, not started yet
    new_tokens: list = field(default_factory=list)  # online: this step's SampleDeltas
    kv_usage: float = 0.0  # the share of the replica's KV blocks in use
    offload: Optional["OffloadStatus"] = None  # pd.offload: its decode attention offload

    @property
    def load(self) -> int:
        """What the replica counts in a PD hand-out: its queue and the transfers on their way."""
        return self.waiting + self.running + self.transfers_pending


@dataclass
class Go:
    """Rank 0 -> every attention rank after each iteration's sync (``tags.GO``), and once
    before the first with its first share of requests (``tags.REQUESTS``)."""

    proceed: bool  # False: stop (or end the loop for a re-plan)
    items: list  # this replica's new requests (PromptInputs), or with PD its transfer messages
    aborts: list = field(default_factory=list)  # request ids this replica ends now (online)
    stream: bool = False  # with the first share: leaders report each step's new tokens (online)


# ---------------------------------------------------------------------- live EPLB
@dataclass
class PlacementUpdate:
    """Expert rank 0 -> every replica leader after a rebalance."""

    phy2log: list  # [L][R] logical expert of each physical slot


# ---------------------------------------------------------------------- prefill-decode
@dataclass(frozen=True)
class WorkItem:
    xfer: int  # the transfer's id (rank 0 counts them)
    input: Any  # PromptInput
    replica: int  # the decode replica that will run it
    offload: int = 0  # pd.offload: tokens to keep room for here (its KV stays); 0: stream it


@dataclass
class PrefillWork:
    """Rank 0 -> a prefill leader (and the leader -> its TP ranks): requests to prefill."""

    items: list  # [WorkItem]


@dataclass(frozen=True)
class PrefillStop:
    """Rank 0 -> every prefill rank: the job is over."""


@dataclass
class PrefillResult:
    xfer: int
    kind: str  # "state" (decode starts it) | "output" (finished at its first token) | "failed"
    payload: Any  # HandoffState, or the RequestOutput


@dataclass
class PrefillReport:
    """A prefill leader -> rank 0 after every step (a heartbeat too)."""

    results: list  # [PrefillResult]
    waiting: int
    running: int
    key_events: list = field(default_factory=list)
    busy_s: float = 0.0  # seconds busy so far: its prefill steps, and with pd.offload serving


@dataclass(frozen=True)
class Expect:
    """To a decode replica: post the receives of a transfer and reserve its blocks."""

    xfer: int
    src: int  # the prefill replica's first rank
    num_tokens: int  # the prompt's
    request_id: str
    offload: bool = False  # its KV stays on the prefill rank: nothing to receive or reserve


@dataclass(frozen=True)
class Start:
    """To a decode replica: the first token is sampled; take the KV and start the request."""

    xfer: int
    state: Any  # HandoffState


@dataclass(frozen=True)
class Drop:
    """To a decode replica: finished or refused at the prefill rank; give the blocks back."""

    xfer: int
    sent: bool  # whether the KV was sent (take it) or not (cancel the receives)


@dataclass(frozen=True)
class OffloadHome:
    """To a decode replica (``pd.offload``): the offloaded request of this transfer comes home:
    its KV moves from the prefill rank's pool into this replica's blocks before the next step
    (``pd/offload_home.py``); the prefill rank needs its room."""

    xfer: int


# ---------------------------------------------------------------------- decode attention offload
@dataclass
class OffloadQKV:
    """A decode attention rank -> the prefill rank holding some of its requests' KV
    (``pd.offload``; ``tags.OFFLOAD_QKV``): one layer of one micro-batch, every offloaded
    request of it on that prefill rank (one new token each). ``q`` [S, Hq, D], ``k``/``v``
    [S, Hkv, D] in the model's dtype, rotary applied (MLA: ``q`` q_nope [S, H, Dn], ``k`` q_pe
    [S, H, P], ``v`` the new latent [S, R+P]); ``context_lens[i]``: tokens of request
    ``xfers[i]`` cached before this one (its new k/v go to that position)."""

    seq: int  # this decode rank's message count to that prefill rank (the reply echoes it)
    layer: int
    part: int  # which of the prefill rank's head slices (OffloadPool.slices): the sender's heads
    xfers: list  # [int] the requests' transfer ids (rank 0's)
    context_lens: list  # [int]
    q: Any
    k: Any
    v: Any


@dataclass
class OffloadOut:
    """The prefill rank's answer (``tags.OFFLOAD_OUT``): the attention output [S, Hq, D] (MLA:
    [S, H, V])."""

    seq: int
    out: Any


@dataclass(frozen=True)
class OffloadStatus:
    """A decode replica's decode attention offload, in its ``ReplicaStatus`` (its first TP
    rank's ``OffloadClient``); summed over the replicas, rank 0's report of them all
    (``pd/offload_report.py``)."""

    offloaded: int  # requests whose decode attention runs on a prefill rank now
    started: int  # requests offloaded so far (ever)
    round_trip_s: tuple = ()  # per-layer round trips (q/k/v out, output back) since the last
    returned_home: int = 0  # offloaded requests whose KV moved home so far (ever)


@dataclass
class OffloadRelease:
    """A decode attention rank -> the prefill rank (``tags.OFFLOAD_QKV``, after that request's
    last ``OffloadQKV``): these requests finished, were aborted, dropped or preempted (they
    recompute on the decode rank): free their blocks."""

    xfers: list


@dataclass(frozen=True)
class OffloadReturn:
    """A decode attention rank -> the prefill rank (``tags.OFFLOAD_QKV``, after the request's
    last ``OffloadQKV``): send the first ``num_tokens`` tokens of this request's KV in head
    slice ``part`` home, layer by layer as a KV transfer (``kv_stream``'s tags and layout), then
    free its blocks (once every slice went)."""

    xfer: int
    num_tokens: int
    part: int


# ---------------------------------------------------------------------- re-planning
@dataclass(frozen=True)
class ReplanOrder:
    """Rank 0 -> every rank: the iteration loop ended at a boundary; switch to ``new``."""

    iteration: int  # the iteration the new plan starts at (every rank's counter)
    old: tuple  # (attention replicas, expert ranks, micro-batches)
    new: tuple
    reason: str  # "forced" or the decision's description
    predicted_gain: float = float("nan")
    kind: str = "measured"  # who ordered it: forced | measured | planner
    stream: bool = False  # the loops that resume report each step's new tokens (a streaming core)

    def name(self, p: tuple) -> str:
        """'a2e2', or 'a2e2m3' when the order changes the micro-batch count."""
        return f"a{p[0]}e{p[1]}" + (f"m{p[2]}" if self.old[2] != self.new[2] else "")

    @property
    def label(self) -> str:
        return f"{self.name(self.old)} -> {self.name(self.new)}"


@dataclass
class ExpertSamples:
    """An expert rank -> rank 0 every ``replan.interval`` iterations."""

    iteration: int
    samples: list  # [(token-expert pairs, seconds)] per expert span
    slots_per_rank: int
    reply_ends: list  # [(iteration, layer, micro-batch, end us)] per E2A span


@dataclass(frozen=True)
class SampleMove:
    index: int  # the sample's index in its request group
    choice: str  # "move" (KV travels) | "recompute" | "waiting" (not started)
    computed: int  # its computed tokens


@dataclass
class GroupHeader:
    """A leaving replica -> a staying one: one request group, its samples' KV to follow."""

    head: Any  # the Request holding every sample
    caller_id: Any
    samples: list  # [SampleMove]


@dataclass(frozen=True)
class ExpertSpans:
    """An expert rank -> rank 0 while served online with tracing on (``span_report``): its
    spans since its last report; ``last``: the job is over, no report follows."""

    rank: int
    expert_s: list[float] = field(default_factory=list)  # each (layer, micro-batch) expert span
    # each A2E receive wait that blocked: ((iteration, layer, micro-batch), its end in us)
    arrivals: list[tuple] = field(default_factory=list)
    last: bool = False
