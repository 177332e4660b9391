"""A re-plan's attention side: the requests of replicas that become expert ranks move to the
replicas that stay (docs/replan.md).

At the switch the pipeline is drained (it happens at an iteration boundary: every micro-batch
of the last step came back). Each leaving replica hands its unfinished requests out in its
queue order, running first, to the staying replicas in turn. A request whose KV is computed
either keeps it (``move``: its blocks travel, one buffer of all layers; the receiver takes
fresh blocks, copies them in and the request goes on decoding where it stopped) or drops it
(``recompute``: it waits again with nothing computed, as after a preemption, and the next
steps recompute prompt + generated tokens). ``replan.kv_transfer=auto`` picks the cheaper:
its KV bytes over ``replan.link_gbps`` against its computed tokens at the replica's measured
seconds per token. A request not started yet just moves. The choice of each is counted and
logged. Sampling state travels with the request (seed, outputs, logprobs), so the tokens that
follow are the ones it would have produced where it was.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from megainfer.engine.request import RequestStatus

log = logging.getLogger("megainfer.runtime")
TAG_HEADERS, TAG_KV = 1, 2  # on the switch communicator


class ReplanError(RuntimeError):
    """A re-plan cannot go on; names the rank and what it could not move."""


def _block_dim(engine) -> int:
    return 0 if engine.kv_spec.kind == "mla" else 1


def _seconds_per_token(engine) -> float:
    log_ = getattr(engine.executor, "step_log", [])[-32:]
    tokens = sum(t for _, t, _ in log_)
    return sum(s for _, _, s in log_) / tokens if tokens else 0.0


def _kv_bytes(engine, blocks: int) -> int:
    d = _block_dim(engine)
    return blocks * sum(kv.select(d, 0).numel() * kv.element_size() for kv in engine.kv_caches)


def _export_kv(engine, table: list[int]) -> np.ndarray:
    """The blocks' KV of every layer as one host byte buffer."""
    d = _block_dim(engine)
    idx = torch.tensor(table, dtype=torch.long, device=engine.kv_caches[0].device)
    parts = [kv.index_select(d, idx).contiguous().view(torch.uint8).flatten().cpu()
             for kv in engine.kv_caches]
    return torch.cat(parts).numpy()


def _import_kv(engine, table: list[int], buf: np.ndarray) -> None:
    d = _block_dim(engine)
    idx = torch.tensor(table, dtype=torch.long, device=engine.kv_caches[0].device)
    data, off = torch.from_numpy(buf), 0
    for kv in engine.kv_caches:
        shape = list(kv.shape)
        shape[d] = len(table)
        n = int(np.prod(shape)) * kv.element_size()
        part = data[off:off + n].view(kv.dtype).view(shape).to(kv.device)
        kv.index_copy_(d, idx, part)
        off += n


def _newest(sched, limit: int) -> list:
    """Up to ``limit`` single-sample requests from the back of the queue (waiting ones first,
    then the most recently started), returned in queue order."""
    queue = list(sched.running) + list(sched.waiting)
    picked = [r for r in reversed(queue) if len(r.samples) <= 1 and not r.pending][:limit]
    chosen = set(map(id, picked))
    return [r for r in queue if id(r) in chosen]


def hand_out(engine, ids: dict, dests: list[int], mode: str, link_Bps: float, tag: str,
             limit=None):
    """Take unfinished requests out of ``engine``: every one (a leaving replica), or the
    ``limit`` newest (a replica giving some to a new one). Returns {dest rank: [(header, kv
    bytes or None)]} in queue order, and the counts per choice."""
    sched, bs = engine.scheduler, engine.cache_config.block_size
    reqs = list(sched.running) + list(sched.waiting) if limit is None else _newest(sched, limit)
    per_tok = _seconds_per_token(engine)
    out, counts = {d: [] for d in dests}, {"move": 0, "recompute": 0, "waiting": 0}
    for j, req in enumerate(reqs):
        if len(req.samples) > 1 or req.pending:
            raise ReplanError(f"{tag}: request {req.request_id!r} has n={req.params.n} samples; "
                              "moving a request of several samples is not supported")
        n = req.num_computed_tokens
        blocks = -(-n // bs)
        choice = "waiting" if n == 0 else mode
        if choice == "auto":
            move_s = _kv_bytes(engine, blocks) / link_Bps
            choice = "move" if move_s <= n * per_tok else "recompute"
        kv = _export_kv(engine, req.block_table[:blocks]) if choice == "move" else None
        if req in sched.running:
            sched.running.remove(req)
        else:
            sched.waiting.remove(req)
        engine.blocks.free_request(req)
        engine.requests.pop(req.request_id, None)
        req.block_table, req.block_uids = [], []
        header = (req, ids.pop(req.request_id, req.request_id), choice, n)
        out[dests[j % len(dests)]].append((header, kv))
        counts[choice] += 1
    return out, counts


def take_in(engine, ids: dict, items: list, tag: str) -> dict:
    """Staying replica: install the requests a leaving replica handed over (in its order)."""
    sched, counts, back = engine.scheduler, {"move": 0, "recompute": 0, "waiting": 0}, []
    for (req, caller_id, choice, n), kv in items:
        req.seq_id = engine._next_seq_id
        engine._next_seq_id += 1
        engine.requests[req.request_id] = req
        ids[req.request_id] = caller_id
        if choice == "move" and engine.blocks.allocate(req, n):
            _import_kv(engine, req.block_table, kv)
            req.num_computed_tokens, req.status = n, RequestStatus.RUNNING
            sched.running.append(req)
            engine.blocks.cache_full_blocks(req)
        else:
            if choice == "move":
                log.info("%s re-plan: no free blocks for request %r's KV; recomputing it",
                         tag, req.request_id)
                choice = "recompute"
            req.num_computed_tokens, req.status = 0, RequestStatus.WAITING
            back.append(req)
        counts[choice] += 1
    sched.waiting.extendleft(reversed(back))  # ahead of what never started here
    return counts


def balance_shares(counts: list[int], old: int, new: int) -> list[int]:
    """Replicas 0..old-1 hold ``counts`` requests; replicas old..new-1 are new and empty:
    how many each old replica gives away so that none keeps more than its fair share."""
    fair = -(-sum(counts[:old]) // new)
    return [max(0, c - fair) for c in counts[:old]]


def migrate(control, loop_or_none, leaving: list[int], staying: list[int], mode: str,
            link_Bps: float, tag: str, limit=None) -> dict:
    """Collective over ``control.comm`` (every rank calls it): ``leaving`` replicas send (all
    their requests, or the ``limit[rank]`` newest), ``staying`` ones receive, every wait
    bounded. Returns this rank's counts: the KV bytes it sent, the requests it took in by
    choice (move, recompute, waiting)."""
    sw = control.comm
    me = sw.Get_rank()
    counts = {"move": 0, "recompute": 0, "waiting": 0, "kv_bytes": 0}
    if me in leaving:  # counts the bytes it sent; the receivers count the requests
        engine = loop_or_none.engine
        out, c = hand_out(engine, loop_or_none.ids, staying, mode, link_Bps, tag,
                          None if limit is None else limit[me])
        log.info("%s re-plan: handing out %d requests with their KV, %d to recompute, %d not "
                 "started", tag, c["move"], c["recompute"], c["waiting"])
        reqs = []
        for dest in staying:
            control.send([h for h, _ in out[dest]], dest, TAG_HEADERS)
            for _, kv in out[dest]:
                if kv is not None:
                    reqs.append((sw.Isend(kv, dest=dest, tag=TAG_KV), dest))
                    counts["kv_bytes"] += kv.nbytes
        for req, dest in reqs:
            control.wait(req, dest, "re-plan KV hand-over (sending)")
    elif me in staying:
        engine = loop_or_none.engine
        for src in leaving:
            headers = control.recv(src, TAG_HEADERS, "re-plan request hand-over")
            items = []
            for h in headers:
                kv = None
                if h[2] == "move":
                    blocks = -(-h[3] // engine.cache_config.block_size)
                    kv = np.empty(_kv_bytes(engine, blocks), dtype=np.uint8)
                    control.wait(sw.Irecv(kv, source=src, tag=TAG_KV), src,
                                 "re-plan KV hand-over (receiving)")
                items.append((h, kv))
            c = take_in(engine, loop_or_none.ids, items, tag)
            for k, v in c.items():
                counts[k] += v
    return counts
