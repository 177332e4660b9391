"""ExpertLoadWindow: sliding window sums, physical-slot counting, JSON, heat map."""
import json

import pytest
import torch

from megainfer.eplb.placement import Placement
from megainfer.eplb.stats import ExpertLoadWindow, StatsError, save_heatmap

L, N, W = 2, 6, 3


def batches(seed: int, iters: int):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, N, (int(torch.randint(0, 9, (1,), generator=g)), 2), generator=g)
             for _ in range(L)] for _ in range(iters)]


def test_window_keeps_the_last_w_iterations():
    win = ExpertLoadWindow(L, N, W)
    its = batches(0, 7)
    ref = []
    for i, it in enumerate(its):
        for layer, ids in enumerate(it):
            win.record(layer, ids)
        # the iteration in progress is not in the window yet
        assert torch.equal(win.load(), sum(ref[-W:], torch.zeros(L, N, dtype=torch.int64)))
        win.end_iteration()
        ref.append(torch.stack([torch.bincount(ids.flatten(), minlength=N) for ids in it]))
        assert win.filled == min(i + 1, W) and win.iterations == i + 1
        assert torch.equal(win.load(), torch.stack(ref[-W:]).sum(0))
        assert torch.equal(win.history(), torch.stack(ref[-W:]))   # oldest first
    win.reset()
    assert win.filled == 0 and int(win.load().sum()) == 0


def test_record_physical_and_counts():
    pl = Placement.from_rebalance(torch.tensor([[9.0, 1, 1, 1, 1, 1]] * L), 8, 1, 1, 2)
    ids = torch.tensor([[0, 1], [0, 2], [0, 5], [3, 0]])
    a, b = ExpertLoadWindow(L, N, W), ExpertLoadWindow(L, N, W)
    for layer in range(L):
        a.record(layer, ids)
        b.record_physical(layer, pl.choose_replicas(layer, ids), pl.phy2log)
    a.record_counts(1, torch.tensor([1, 0, 0, 0, 0, 2]))
    b.record(1, torch.tensor([0, 5, 5]))
    a.end_iteration()
    b.end_iteration()
    assert torch.equal(a.load(), b.load())
    assert a.load()[0].tolist() == [4, 1, 1, 1, 0, 1]


def test_bad_input_is_named():
    win = ExpertLoadWindow(L, N, W)
    with pytest.raises(StatsError, match="topk_ids"):
        win.record(0, torch.tensor([[0, N]]))
    with pytest.raises(StatsError, match="layer"):
        win.record(L, torch.tensor([[0]]))
    with pytest.raises(StatsError, match="counts"):
        win.record_counts(0, torch.ones(N + 1))
    with pytest.raises(StatsError, match="window"):
        ExpertLoadWindow(L, N, 0)


def test_json_round_trip(tmp_path):
    win = ExpertLoadWindow(L, N, W)
    for it in batches(1, 5):
        for layer, ids in enumerate(it):
            win.record(layer, ids)
        win.end_iteration()
    path = tmp_path / "load.json"
    win.save_json(str(path), with_history=True)
    d = json.loads(path.read_text())
    assert d["load"] == win.load().tolist() and d["window"] == W and d["iterations"] == 5
    back = ExpertLoadWindow.from_dict(d)
    assert torch.equal(back.load(), win.load()) and torch.equal(back.history(), win.history())
    assert back.iterations == 5
    with pytest.raises(StatsError, match="history"):
        ExpertLoadWindow.from_dict(win.to_dict())


def test_heatmap_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (dev extra) draws the heat map")
    win = ExpertLoadWindow(L, N, W)
    win.record(0, torch.tensor([[0, 1], [0, 3]]))
    win.end_iteration()
    path = tmp_path / "sub" / "heat.png"
    win.save_heatmap(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    save_heatmap(torch.zeros(3, 4), str(tmp_path / "zero.png"))  # all-zero load must not crash
    assert (tmp_path / "zero.png").stat().st_size > 0
