"""The offload rule both rank 0's ledger and the PD simulator's book apply
(perfmodel/offload_rule.py): the fixed ratio's picks, and ``auto``'s three conditions (pool room,
decode KV pressure, the predicted TPOT within the SLO)."""
import pytest

from megainfer.perfmodel.offload_rule import (Decoding, OffloadCandidate, blocks_for, homes_for_room,
                                             picks_auto, picks_by_ratio)


@pytest.mark.parametrize("ratio,want", [(0, []), (0.5, [1, 3, 5, 7, 9]), (1, list(range(10))),
                                        (0.3, [3, 6, 9])])
def test_ratio_picks_the_kth_request_when_the_floor_steps(ratio, want):
    assert [k for k in range(10) if picks_by_ratio(k, ratio)] == want


def test_blocks_round_up():
    assert [blocks_for(t, 16) for t in (1, 16, 17, 112)] == [1, 1, 2, 7]


def _c(**kw):
    base = dict(need_blocks=7, pool_free_blocks=21, need_tokens=112, decode_free_tokens=100)
    return OffloadCandidate(**dict(base, **kw))


def test_auto_offloads_under_decode_kv_pressure_while_the_pool_has_room():
    assert picks_auto(_c())  # 112 tokens do not fit in the decode replica's 100 free
    assert not picks_auto(_c(decode_free_tokens=112))  # fits locally: no pressure, no offload
    assert not picks_auto(_c(pool_free_blocks=6))  # the pool has no room for its life
    assert picks_auto(_c(pool_free_blocks=7))


def test_auto_keeps_the_predicted_tpot_within_the_slo():
    assert picks_auto(_c(tpot_s=0.09, tpot_slo_s=0.1))
    assert not picks_auto(_c(tpot_s=0.11, tpot_slo_s=0.1))  # the extra round trip breaks the SLO
    assert picks_auto(_c(tpot_s=0.11))  # no SLO set
    assert picks_auto(_c(tpot_slo_s=0.1))  # no prediction (rank 0): pool and pressure only
    assert not picks_auto(_c(decode_free_tokens=500, tpot_s=0.01, tpot_slo_s=0.1))


def test_homes_for_room_frees_the_pool_oldest_first_while_decode_kv_holds_them():
    """A newcomer needs 8 pool blocks, 2 are free: the oldest decoding request (5 blocks) fits
    its replica's KV and goes, the next (4 blocks) does not fit replica 0 beside it and is
    passed over, the third (3 blocks, replica 1) goes: 10 free. Too little to free: none goes."""
    dec = [Decoding("a", 5, 0, 40), Decoding("b", 4, 0, 40), Decoding("c", 3, 1, 30)]
    go = homes_for_room(8, 2, dec, [30, 0], kv_cap=100)
    assert [d.key for d in go] == ["a", "c"]
    assert [d.key for d in homes_for_room(6, 2, dec, [30, 0], kv_cap=100)] == ["a"]
    assert homes_for_room(20, 2, dec, [30, 0], kv_cap=100) is None
    assert homes_for_room(8, 2, dec, [90, 90], kv_cap=100) is None  # no replica has room
    assert [d.key for d in homes_for_room(8, 2, dec, [90, 90], kv_cap=None)] == ["a", "b"]
