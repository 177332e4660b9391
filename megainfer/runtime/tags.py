"""Every MPI tag megainfer uses (the runtime's and the calibration's), with the communicator it
rides: one table, ``TAGS``.

A tag only has to be unique among the messages of one communicator (``job``, ``experts``,
``switch``, ``kv``, ``bounded``, ``channel``, ``calibration``), so equal values on different
communicators are fine; ``tests/unit/runtime/test_runtime_layout.py`` checks that no two entries
of one communicator overlap and that no tag is defined outside this table. A range
(``Tag.span > 1``) is a base plus an offset its owner computes (``EPLB_WEIGHTS``,
``REPLAN_EXPERT``, ``KV_SEGMENT``).
docs/architecture.md, "Runtime rooms".
"""
from __future__ import annotations

from dataclasses import dataclass

from megainfer.comm.channel import MAX_CHANNELS, MAX_STREAMS


@dataclass(frozen=True)
class Tag:
    value: int
    comm: str  # the communicator it rides (module docstring)
    what: str  # the message: who sends what to whom
    span: int = 1  # how many tags from ``value`` on it may use (None-like: up to TAG_UB)


MPI_TAG_UB_MIN = 32767  # the smallest TAG_UB the MPI standard allows

# the control plane (runtime/control.py): rank 0 and the attention ranks, every iteration
REQUESTS, STATUS, GO = 101, 102, 103
EPLB_PLACEMENT = 105  # expert rank 0 -> replica leaders: the new phy2log
REPLAN_ORDER = 106  # rank 0 -> every rank: the order ending a loop (None: the job is over)
REPLAN_SAMPLES = 107  # expert rank -> rank 0: measured spans for a decision
ARRIVE = 108  # BoundedComm: every rank -> every other, "I reached call k"
SERVE_SPANS = 109  # expert rank -> rank 0, served online with tracing: its T_e and A2E spans
EPLB_WEIGHTS = 1000  # host-staged expert weights among expert ranks (+ layer * slots + slot)
PD_WORK, PD_DONE = 201, 202  # rank 0 <-> prefill ranks
OFFLOAD_QKV, OFFLOAD_OUT = 203, 204  # decode attention rank <-> prefill rank (pd.offload)
KV_SEGMENT = 1000  # one (transfer, layer, segment) of prefill KV, up to TAG_UB
REPLAN_HEADERS, REPLAN_KV, REPLAN_CHECKPOINT = 1, 2, 3  # the switch's own communicator
REPLAN_EXPERT = 2000  # a re-plan's host-staged expert weights (+ layer * slots + slot)
PING, PONG = 7, 8  # calibration: rank 0 -> rank 1, and back

TAGS = (
    Tag(REQUESTS, "job", "rank 0 -> attention ranks: a replica's first share of requests"),
    Tag(STATUS, "job", "replica leader -> rank 0: messages.ReplicaStatus"),
    Tag(GO, "job", "rank 0 -> attention ranks: messages.Go"),
    Tag(EPLB_PLACEMENT, "job", "expert rank 0 -> replica leaders: messages.PlacementUpdate"),
    Tag(REPLAN_ORDER, "job", "rank 0 -> every rank: messages.ReplanOrder or None"),
    Tag(REPLAN_SAMPLES, "job", "expert rank -> rank 0: messages.ExpertSamples"),
    Tag(SERVE_SPANS, "job", "expert rank -> rank 0, online: messages.ExpertSpans"),
    Tag(ARRIVE, "bounded", "BoundedComm arrival tokens"),
    Tag(EPLB_WEIGHTS, "experts", "host-staged expert weights of a rebalance",
        span=MPI_TAG_UB_MIN - EPLB_WEIGHTS),
    Tag(PD_WORK, "kv", "rank 0 -> prefill leader (and leader -> its TP ranks): "
        "messages.PrefillWork or messages.PrefillStop"),
    Tag(PD_DONE, "kv", "prefill leader -> rank 0: messages.PrefillReport"),
    Tag(OFFLOAD_QKV, "kv", "decode attention rank -> prefill rank: messages.OffloadQKV "
        "(one per layer per micro-batch) or messages.OffloadRelease"),
    Tag(OFFLOAD_OUT, "kv", "prefill rank -> decode attention rank: messages.OffloadOut"),
    Tag(KV_SEGMENT, "kv", "prefill KV segments (pd/kv_segments.kv_tag)",
        span=MPI_TAG_UB_MIN - KV_SEGMENT),
    Tag(REPLAN_HEADERS, "switch", "leaving replica -> staying one: [messages.GroupHeader]"),
    Tag(REPLAN_KV, "switch", "a moved sample's KV bytes"),
    Tag(REPLAN_CHECKPOINT, "switch", "bounded barrier tokens"),
    Tag(REPLAN_EXPERT, "switch", "host-staged expert weights of a re-plan",
        span=MPI_TAG_UB_MIN - REPLAN_EXPERT),
    Tag(PING, "calibration", "rank 0 -> rank 1: one ping-pong message"),
    Tag(PONG, "calibration", "rank 1 -> rank 0: its echo"),
    Tag(0, "channel", "megainfer.comm.Channel: channel_id * MAX_STREAMS + stream",
        span=MAX_CHANNELS * MAX_STREAMS),
)
