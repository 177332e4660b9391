"""Split one step's sequences into m micro-batches balanced by tokens (contiguous, in order)."""
from __future__ import annotations


def split_by_tokens(query_lens: list[int], m: int) -> list[list[int]]:
    """Sequence indices of each of the m micro-batches; some may be empty.

    Contiguous groups whose token counts are as even as possible: sequence i goes to the
    micro-batch where the midpoint of its tokens falls, on the grid T/m. Deterministic.
    """
    total = sum(query_lens)
    groups: list[list[int]] = [[] for _ in range(m)]
    if total == 0:
        for i in range(len(query_lens)):
            groups[0].append(i)
        return groups
    seen = 0
    for i, n in enumerate(query_lens):
        mid = seen + n / 2
        groups[min(m - 1, int(mid * m / total))].append(i)
        seen += n
    return groups
