"""A re-plan's attention side: the requests of replicas that become expert ranks move to the
replicas that stay (docs/replan.md, "Switch").

At the drained boundary each leaving replica hands its unfinished requests out in queue order,
running first, to the staying replicas in turn. A request whose KV is computed either keeps it
(``move``: its blocks travel through the handoff path PD's decode side uses,
``engine/kv_handoff.py``) or drops it (``recompute``, as after a preemption);
``replan.kv_transfer=auto`` picks the cheaper (its KV bytes over ``replan.link_gbps`` against
its computed tokens at the measured seconds per token). A request of several samples moves as
one group, each sample with its own choice. Sampling state travels with the request (the
sampler's noise depends only on seed and output index), so the tokens that follow are the ones
it would have produced where it was."""
from __future__ import annotations

import logging

import numpy as np

from megainfer.engine.kv_handoff import adopt, export_kv, import_kv, kv_bytes, reserve
from megainfer.engine.request import RequestStatus
from megainfer.runtime import tags
from megainfer.runtime.messages import GroupHeader, SampleMove

log = logging.getLogger("megainfer.runtime")


def _seconds_per_token(engine) -> float:
    log_ = getattr(engine.executor, "step_log", [])[-32:]
    tokens = sum(t for _, t, _ in log_)
    return sum(s for _, _, s in log_) / tokens if tokens else 0.0


def _groups(engine, limit=None) -> list:
    """The unfinished request groups (a request and its samples, ``SamplingParams.n``) in
    queue order (running first, then forks waiting for a seat, then waiting): [(head, [its
    samples in the scheduler, in queue order])]. With ``limit``: the ``limit`` newest groups
    (waiting ones first, then the most recently started), still in queue order."""
    queue = engine.scheduler.queued()
    members: dict = {}
    for s in queue:
        members.setdefault(s.request_id, []).append(s)
    order = list(members)
    if limit is not None:
        last = {s.request_id: i for i, s in enumerate(queue)}
        keep = set(sorted(order, key=last.__getitem__, reverse=True)[:limit])
        order = [rid for rid in order if rid in keep]
    return [(engine.requests[rid], members[rid]) for rid in order]


def group_count(engine) -> int:
    """How many request groups ``engine`` holds unfinished (what ``balance_shares`` counts)."""
    return len({s.request_id for s in engine.scheduler.queued()})


def hand_out(engine, ids: dict, dests: list[int], mode: str, link_Bps: float, label: str,
             limit=None):
    """Take unfinished request groups out of ``engine``: every one (a leaving replica), or the
    ``limit`` newest (a replica giving some to a new one). A group travels whole: its head (the
    ``Request`` that holds every sample, finished ones and samples not forked yet included) and,
    per sample in the scheduler, the choice made for it (its KV moved, recomputed, or not
    started). Returns {dest rank: [(GroupHeader, [kv bytes or None per sample])]} in queue
    order, and the counts per choice (``multi``: samples of requests with n > 1)."""
    bs = engine.cache_config.block_size
    per_tok = _seconds_per_token(engine)
    out = {d: [] for d in dests}
    counts = {"move": 0, "recompute": 0, "waiting": 0, "multi": 0}
    for j, (head, members) in enumerate(_groups(engine, limit)):
        plan, kvs = [], []
        for s in members:
            n = s.num_computed_tokens
            blocks = -(-n // bs)
            choice = "waiting" if n == 0 else mode
            if choice == "auto":
                move_s = kv_bytes(engine, blocks) / link_Bps
                choice = "move" if move_s <= n * per_tok else "recompute"
            kvs.append(export_kv(engine, s.block_table[:blocks]) if choice == "move" else None)
            engine.scheduler.finish(s)  # out of the queue, its blocks freed (shared ones kept)
            s.block_table, s.block_uids = [], []
            plan.append(SampleMove(s.index, choice, n))
            counts[choice] += 1
            counts["multi"] += len(head.samples) > 1
        engine.requests.pop(head.request_id, None)
        header = GroupHeader(head, ids.pop(head.request_id, head.request_id), plan)
        out[dests[j % len(dests)]].append((header, kvs))
    return out, counts


def take_in(engine, ids: dict, items: list, label: str) -> dict:
    """Staying or new replica: install the request groups another replica handed over (in its
    order). Samples whose KV came are running again where they stopped (fresh blocks, not
    shared: a group's samples each bring theirs); the others wait, ahead of what never started
    here. Seeds, outputs and log-probabilities are the request objects' own: they came too."""
    sched, back = engine.scheduler, []
    counts = {"move": 0, "recompute": 0, "waiting": 0, "multi": 0}
    for header, kvs in items:
        head = header.head
        engine.requests[head.request_id] = head
        ids[head.request_id] = header.caller_id
        for k, s in enumerate(head.samples):  # fresh seq ids here, one per sample
            s.seq_id = engine._next_seq_id + k
        engine._next_seq_id += len(head.samples)
        for mv, kv in zip(header.samples, kvs):
            index, choice, n = mv.index, mv.choice, mv.computed
            s = head.samples[index]
            blocks = reserve(engine, n, f"replan {s.request_id}") if choice == "move" else None
            if blocks is not None:  # the KV came: fresh blocks here, as a PD decode side takes
                import_kv(engine, blocks.block_table, kv)
                adopt(s, blocks)
                s.num_computed_tokens = n
                sched.add_running(s)  # (beyond max_num_seqs: it waits for a seat, forked)
                engine.blocks.cache_full_blocks(s)
            else:
                if choice == "move":
                    log.info("%s re-plan: no free blocks for request %r sample %d's KV; "
                             "recomputing it", label, s.request_id, index)
                    choice = "recompute"
                s.num_computed_tokens, s.status = 0, RequestStatus.WAITING
                back.append(s)
            counts[choice] += 1
            counts["multi"] += len(head.samples) > 1
    sched.waiting.extendleft(reversed(back))  # ahead of what never started here
    return counts


def balance_shares(counts: list[int], old: int, new: int) -> list[int]:
    """Replicas 0..old-1 hold ``counts`` requests; replicas old..new-1 are new and empty:
    how many each old replica gives away so that none keeps more than its fair share."""
    fair = -(-sum(counts[:old]) // new)
    return [max(0, c - fair) for c in counts[:old]]


def migrate(control, loop_or_none, leaving: list[int], staying: list[int], mode: str,
            link_Bps: float, label: str, limit=None) -> dict:
    """Collective over ``control.comm`` (every rank calls it): ``leaving`` replicas send (all
    their requests, or the ``limit[rank]`` newest), ``staying`` ones receive, every wait
    bounded. Returns this rank's counts: the KV bytes it sent, the sequences it took in by
    choice (move, recompute, waiting) and how many of them are samples of n > 1 requests."""
    sw = control.comm
    me = sw.Get_rank()
    counts = {"move": 0, "recompute": 0, "waiting": 0, "multi": 0, "kv_bytes": 0}
    if me in leaving:  # counts the bytes it sent; the receivers count the requests
        engine = loop_or_none.engine
        out, c = hand_out(engine, loop_or_none.ids, staying, mode, link_Bps, label,
                          None if limit is None else limit[me])
        log.info("%s re-plan: handing out %d requests with their KV, %d to recompute, %d not "
                 "started", label, c["move"], c["recompute"], c["waiting"])
        reqs = []
        for dest in staying:
            control.send([h for h, _ in out[dest]], dest, tags.REPLAN_HEADERS)
            for _, kvs in out[dest]:
                for kv in kvs:
                    if kv is not None:
                        reqs.append((sw.Isend(kv, dest=dest, tag=tags.REPLAN_KV), dest))
                        counts["kv_bytes"] += kv.nbytes
        for req, dest in reqs:
            control.wait(req, dest, "re-plan KV hand-over (sending)")
    elif me in staying:
        engine = loop_or_none.engine
        for src in leaving:
            headers = control.recv(src, tags.REPLAN_HEADERS, "re-plan request hand-over")
            items = []
            for h in headers:
                kvs = []
                for mv in h.samples:
                    kv = None
                    if mv.choice == "move":
                        blocks = -(-mv.computed // engine.cache_config.block_size)
                        kv = np.empty(kv_bytes(engine, blocks), dtype=np.uint8)
                        control.wait(sw.Irecv(kv, source=src, tag=tags.REPLAN_KV), src,
                                     "re-plan KV hand-over (receiving)")
                    kvs.append(kv)
                items.append((h, kvs))
            c = take_in(engine, loop_or_none.ids, items, label)
            for k, v in c.items():
                counts[k] += v
    return counts
