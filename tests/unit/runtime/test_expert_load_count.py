"""An expert rank's load count (runtime/rebalancer.py ``ExpertRebalancer.record``): only the
tokens that reached this rank's own slots count, by the logical expert each slot holds, and on a
GPU counting never waits for the device (the window lives where the ids are)."""
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from megainfer.config import EplbConfig
from megainfer.eplb import Placement
from megainfer.runtime.rebalancer import ExpertRebalancer

L, E, RANKS, K = 3, 4, 2, 2  # 4 logical experts, 6 physical slots (2 redundant), 3 per rank


def _rebalancer(device: str, index: int) -> ExpertRebalancer:
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2], [0, 0, 1, 2, 3, 1]])
    placement = Placement.from_phy2log(phy2log, E, RANKS)
    experts = SimpleNamespace(gate_up_proj=torch.zeros(3, 4, 2, device=device))
    model = SimpleNamespace(layers=[SimpleNamespace(is_moe=True, mlp=SimpleNamespace(experts=experts))
                                    for _ in range(L)])
    return ExpertRebalancer(model, placement, index, MPI.COMM_SELF, None, [0],
                            EplbConfig(enabled=True, window=4, interval=8))


def _reference(reb: ExpertRebalancer, layer_ids) -> torch.Tensor:
    """The count by indexing (what the rank served, mapped to logical experts)."""
    want = torch.zeros(L, E, dtype=torch.int64)
    p2l = reb.placement.phy2log
    for layer, ids in layer_ids:
        for s in ids.reshape(-1).tolist():
            if reb.mine.start <= s < reb.mine.stop:
                want[layer, p2l[layer, s]] += 1
    return want


@pytest.mark.parametrize("index", [0, 1])
def test_only_local_slots_count_by_logical_expert(index):
    reb = _rebalancer("cpu", index)
    g = torch.Generator().manual_seed(3 + index)
    batches = [(layer, torch.randint(0, 2 * 3, (n, K), generator=g))
               for layer, n in ((0, 7), (1, 5), (2, 9), (0, 4), (2, 0))]
    for layer, ids in batches:
        reb.record(layer, ids)
    assert torch.equal(reb.window.current, _reference(reb, batches))
    served = int(_reference(reb, batches).sum())
    reb.end_iteration()
    reb.record(1, torch.tensor([[reb.mine.start, reb.mine.start]]))
    reb.end_iteration()
    assert reb.tokens_per_iteration == [served, 2]
    assert reb.tokens_per_iteration == [served, 2]  # read twice: the same list
    assert int(reb.window.load().sum()) == served + 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_counting_on_a_gpu_never_synchronises():
    reb = _rebalancer("cuda", 1)
    ids = torch.randint(0, 6, (64, K), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(L):
            reb.record(layer, ids)
        reb.end_iteration()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(reb.window.load().cpu(), _reference(reb, [(layer, ids.cpu()) for layer in range(L)]))
    assert reb.tokens_per_iteration == [int(reb.window.load().sum())]
