"""Which physical expert slots each expert rank holds (static placements; EPLB moves them)."""
from __future__ import annotations


def identity_slots(num_slots: int, expert_ranks: int) -> list[list[int]]:
    """Contiguous, as even as possible: 8 slots over 3 ranks -> [0,1,2] [3,4,5] [6,7]."""
    if expert_ranks < 1 or expert_ranks > num_slots:
        raise ValueError(f"deploy.expert_ranks={expert_ranks}: must be in [1, {num_slots}] "
                         f"for {num_slots} expert slots")
    base, extra = divmod(num_slots, expert_ranks)
    out, start = [], 0
    for r in range(expert_ranks):
        n = base + (r < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out
