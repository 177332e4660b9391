"""Rank 0's tally of the decode replicas' offload reports (``pd.offload``), for the served
metrics (docs/serve.md, "Metrics (`GET /metrics`)").

Each step every decode replica's leader puts its ``messages.OffloadStatus`` into its
``ReplicaStatus``; ``OffloadTally.add`` sums one iteration's: the requests offloaded now and
ever are the latest sums, the round trips pile up until ``take`` (the engine core, once per
round: ``OnlineEngine.offload_report``), the latest ``PENDING_ROUND_TRIPS`` at most (an
offline job takes none). docs/pd.md, "Decode attention offloaded to the prefill ranks".
"""
from __future__ import annotations

from collections import deque

from megainfer.runtime.messages import OffloadStatus

PENDING_ROUND_TRIPS = 4096  # round trips kept for the next report at most (the oldest go first)


class OffloadTally:
    def __init__(self):
        self.offloaded = 0  # requests whose decode attention runs on a prefill rank now
        self.started = 0  # requests offloaded so far
        self.returned_home = 0  # offloaded requests whose KV moved home so far
        self.round_trip_s: deque = deque(maxlen=PENDING_ROUND_TRIPS)  # not taken yet

    def add(self, statuses) -> None:
        """One iteration's ``ReplicaStatus`` of every decode replica."""
        now = [st.offload for st in statuses if st.offload is not None]
        self.offloaded = sum(o.offloaded for o in now)
        self.started = sum(o.started for o in now)
        self.returned_home = sum(o.returned_home for o in now)
        for o in now:
            self.round_trip_s.extend(o.round_trip_s)

    def take(self) -> OffloadStatus:
        """Summed over the decode replicas: offloaded now, ever, the round trips since the
        last call."""
        trips = tuple(self.round_trip_s)
        self.round_trip_s.clear()
        return OffloadStatus(self.offloaded, self.started, trips, self.returned_home)
