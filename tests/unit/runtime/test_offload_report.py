"""What a decode replica reports of its offloaded decode attention and how rank 0 sums it
(``pd/offload_report.py``): offloaded now and ever are the latest sums over the replicas, the
round trips pile up until taken and then start again, both sides keep the latest
``PENDING_ROUND_TRIPS`` at most; a replica without offload counts nothing."""
from megainfer.runtime.messages import OffloadStatus, ReplicaStatus
from megainfer.runtime.pd.offload_decode import RoundTrips
from megainfer.runtime.pd.offload_report import PENDING_ROUND_TRIPS, OffloadTally


def _status(offload=None) -> ReplicaStatus:
    return ReplicaStatus([], True, 0, 1, offload=offload)


def test_tally_sums_replicas_and_hands_round_trips_out_once():
    t = OffloadTally()
    assert t.take() == OffloadStatus(0, 0, ())
    t.add([_status(OffloadStatus(1, 1, (0.001, 0.002))), _status(OffloadStatus(2, 3, (0.004,)))])
    t.add([_status(OffloadStatus(0, 2, ())), _status(OffloadStatus(1, 4, (0.003,)))])
    assert t.take() == OffloadStatus(1, 6, (0.001, 0.002, 0.004, 0.003))  # now: the last sums
    assert t.take() == OffloadStatus(1, 6, ())  # the round trips went with the last take
    t.add([_status(), _status(OffloadStatus(0, 4, (0.005,)))])  # no offload on replica 0
    assert t.take() == OffloadStatus(0, 4, (0.005,))


def test_round_trips_pending_are_bounded_on_both_sides():
    t = OffloadTally()
    for i in range(3):  # nobody takes (an offline job): the latest PENDING_ROUND_TRIPS stay
        t.add([_status(OffloadStatus(1, 1, tuple(float(i * 3000 + j) for j in range(3000))))])
    got = t.take().round_trip_s
    assert len(got) == PENDING_ROUND_TRIPS and got[-1] == 8999.0
    assert got[0] == 9000.0 - PENDING_ROUND_TRIPS
    trips = RoundTrips()
    for i in range(PENDING_ROUND_TRIPS + 10):
        trips.add(i * 1e-3, 0.0)
    assert trips.count == PENDING_ROUND_TRIPS + 10 and len(trips.samples_ms) == 4096
    pending = trips.take()
    assert len(pending) == PENDING_ROUND_TRIPS and pending[0] == 10e-3
    assert trips.take() == () and trips.count == PENDING_ROUND_TRIPS + 10  # totals stay
