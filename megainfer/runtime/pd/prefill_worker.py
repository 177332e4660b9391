"""A prefill replica (docs/pd.md): the whole model with its experts local, on one rank or split
over ``deploy.prefill_tp`` ranks (``prefill_experts``), running whole prompts, sampling each
request's first token and handing the request to the decode replica rank 0 chose. Under TP the
leader talks to rank 0 and forwards each iteration's work, so every TP rank's engine stays
identical; each streams its own KV heads.

``PrefillExecutor`` is ``LocalExecutor`` plus a hook per decoder layer: once layer l has run,
its completed KV segments are posted (``KVSender``) while layer l+1 computes.
``PrefillWorker`` is the rank's loop: rank 0 sends ``PrefillWork`` or ``PrefillStop``
(``tags.PD_WORK``); after every step the rank answers a ``PrefillReport`` (``tags.PD_DONE``; a
heartbeat too, with its prefix-cache key events), each result a ``state`` (decode starts the
request), ``output`` (finished at its first token) or ``failed`` (nothing was sent)."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.engine.errors import RequestError
from megainfer.engine.kv_handoff import detach, export_state
from megainfer.engine.outputs import RequestOutput
from megainfer.engine.step import LocalExecutor
from megainfer.perfmodel.trace import KV_SEND, PREFILL, kv_transfer_name, prefill_step_name
from megainfer.runtime import tags
from megainfer.runtime.control import Outbox, RankFailure
from megainfer.runtime.messages import (PrefillReport, PrefillResult, PrefillStop, PrefillWork,
                                         WorkItem)
from megainfer.runtime.pd.kv_stream import KVSender, OutgoingKV

log = logging.getLogger("megainfer.runtime")


class PrefillExecutor(LocalExecutor):
    """``LocalExecutor`` that streams each completed prompt's KV out layer by layer."""

    def __init__(self, model, kv_caches, block_size: int, sender: KVSender):
        super().__init__(model, kv_caches, block_size)
        self.sender = sender
        self.planned: dict[int, OutgoingKV] = {}  # seq_id -> its transfer, until its prompt is done
        # pd.offload: the OffloadPool (set by pd/build.py), served after every layer; else None
        self.offload = None
        for l, layer in enumerate(model.layers):
            layer.register_forward_hook(self._hook(l))

    def _hook(self, l: int):
        def after_layer(module, args, output):
            if self.sender.active:
                self.sender.send_layer(l, self.kv_caches[l])
            if self.offload is not None:
                self.offload.serve()
        return after_layer

    @torch.inference_mode()
    def execute(self, step):
        final = set(step.sample_rows)  # sampled here = its prompt completes in this step
        for i, sid in enumerate(step.seq_ids):
            o = self.planned.get(sid)
            if o is not None:
                self.sender.begin(o, step.block_tables[i],
                                  step.context_lens[i] + step.query_lens[i], i in final)
                if i in final:
                    del self.planned[sid]
        logits = super().execute(step)
        self.sender.end_step()
        return logits


class PrefillWorker:
    def __init__(self, engine, executor: PrefillExecutor, comm: MPI.Comm, dests: list, label: str,
                 policy: WaitPolicy, tracer=None, track_keys: bool = False,
                 peers: Optional[MPI.Comm] = None):
        self.engine, self.executor, self.comm, self.label = engine, executor, comm, label
        self.peers = peers  # this prefill replica's TP ranks (None: one rank)
        self.leader = peers is None or peers.Get_rank() == 0
        self.peer_outbox = Outbox(peers) if peers is not None else None  # leader's forwards
        self.dests = dests  # per decode replica: [Dest] of its TP ranks
        self.policy = policy
        # idle with KV sends in flight: back every 50 ms to drive them; else one long wait
        self.sending_policy = replace(policy, timeout_s=min(0.05, policy.timeout_s))
        self.tracer = tracer
        self.xfer_of: dict[str, int] = {}  # engine request id -> transfer id
        self.keep: dict[str, int] = {}  # pd.offload: request id -> tokens its KV keeps room for
        self.transfers: list[OutgoingKV] = []  # completed, for the stats
        self.steps = 0
        self.prompt_s = 0.0  # seconds in prefill steps, offloaded attention served in them aside
        self.outbox = Outbox(comm)  # reports to rank 0 in flight
        self.track = track_keys
        if track_keys:
            engine.blocks.track_keys()

    def run(self) -> int:
        """Serve rank 0 until it says stop; returns the number of steps run."""
        while True:
            if self.leader:
                work = self._receive(block=not self.engine.has_unfinished())
                self._forward(work)
            else:
                work = self._from_leader()
            if isinstance(work, PrefillStop):
                self.outbox.flush()  # rank 0 took every report before stopping
                if self.peer_outbox is not None:
                    self.peer_outbox.flush()
                self.executor.sender.drain()
                self._collect()
                if self.executor.offload is not None:
                    self.executor.offload.drain()
                return self.steps
            report = [self._add(item) for item in work]
            report = [r for r in report if r is not None]
            stepped = self.engine.has_unfinished()
            if stepped:
                report += self._step()
            if self.leader and (stepped or report):  # after every step: a heartbeat too
                self._report(report)
            self._check_sends()

    def _forward(self, work) -> None:
        """Leader: this iteration's work (maybe none) or STOP to the replica's other TP ranks,
        so every one adds the same requests and steps at the same iteration (their engines stay
        identical; the steps' all-reduces keep them in lockstep)."""
        if self.peers is None:
            return
        for t in range(1, self.peers.Get_size()):
            msg = work if isinstance(work, PrefillStop) else PrefillWork(work)
            self.peer_outbox.post(msg, t, tags.PD_WORK)

    def _from_leader(self):
        """A TP rank other than the leader: the leader's next message (idle is legitimate, as
        the leader's own wait for rank 0; a dead leader ends the job through the process
        manager, or rank 0 notices the silent prefill replica)."""
        while not self.peers.Iprobe(source=0, tag=tags.PD_WORK):
            self._idle_wait(lambda: self.peers.Iprobe(source=0, tag=tags.PD_WORK))
        msg = self.peers.recv(source=0, tag=tags.PD_WORK)
        return msg if isinstance(msg, PrefillStop) else msg.items

    def _report(self, report: list) -> None:
        """Non-blocking: rank 0 may be sending us work at the same time (no send waits on a
        receive that waits on it)."""
        s, b = self.engine.scheduler, self.engine.blocks
        pool = self.executor.offload
        msg = PrefillReport(report, s.num_waiting, len(s.running),
                            b.take_key_events() if self.track else [],
                            self.prompt_s + (pool.serve_s if pool is not None else 0.0))
        self.outbox.post(msg, 0, tags.PD_DONE)

    def _receive(self, block: bool):
        """Everything rank 0 sent since the last call (a list of ``WorkItem``, or
        ``PrefillStop``)."""
        items = []
        while True:
            st = MPI.Status()
            if not self.comm.Iprobe(source=0, tag=tags.PD_WORK, status=st):
                if items or not block:
                    return items
                self._idle_wait(lambda: self.comm.Iprobe(source=0, tag=tags.PD_WORK))
                continue  # idle is legitimate (decode may run long); rank 0 ends us with STOP
            msg = self.comm.recv(source=0, tag=tags.PD_WORK)
            if isinstance(msg, PrefillStop):
                return msg
            items += msg.items

    def _idle_wait(self, arrived) -> None:
        """Nothing to run: drive the KV sends in flight, then wait for ``arrived()`` (rank 0's
        or the leader's next message) up to 50 ms while sends are in flight, else up to the
        policy's timeout (a timeout here is no error: the caller looks again)."""
        self.executor.sender.poll()
        self._check_sends()
        policy = self.sending_policy if self.executor.sender.inflight else self.policy
        pool = self.executor.offload
        if pool is None:
            wait_until(arrived, policy)
            return
        pool.serve()  # offloaded decode attention is answered while idle too: while it holds
        # requests, back every 50 ms at most (the wait's sleeps stay short, so a decode step's
        # message is seen soon after it arrives)
        short = self.sending_policy if pool.held else policy
        wait_until(lambda: arrived() or pool.pending(), short)
        pool.serve()

    def _add(self, item: WorkItem):
        xfer, inp, replica = item.xfer, item.input, item.replica
        try:
            req = self.engine.add_request(inp.request_id, inp.prompt, inp.params,
                                          prompt_token_ids=inp.prompt_token_ids)
        except RequestError as e:
            log.warning("%s request %r refused: %s", self.label, inp.request_id, e)
            return PrefillResult(xfer, "failed", RequestOutput.failed(inp.request_id, inp.prompt,
                                                                      inp.prompt_token_ids, e))
        self.xfer_of[req.request_id] = xfer
        if item.offload:  # its KV stays here (pd.offload): nothing is streamed
            self.keep[req.request_id] = item.offload
        elif self.dests[replica]:  # a TP rank whose heads go elsewhere (MLA: rank 0's) sends none
            self.executor.planned[req.seq_id] = OutgoingKV(xfer, req.request_id,
                                                         self.dests[replica], req.num_prompt_tokens)
        return None

    def _step(self) -> list:
        t0 = time.perf_counter()
        pool = self.executor.offload
        served0 = pool.serve_s if pool is not None else 0.0
        finished = self.engine.step()
        self.steps += 1
        report = [PrefillResult(self.xfer_of.pop(out.request_id), "output", out)
                  for out in finished]
        for out in finished:
            self.keep.pop(out.request_id, None)
        for req in [r for r in self.engine.requests.values() if r.output_token_ids]:
            keep = self.keep.pop(req.request_id, 0)
            if keep:
                self.executor.offload.keep(self.xfer_of[req.request_id], req, keep)
            state = export_state(req)
            detach(self.engine, req)
            report.append(PrefillResult(self.xfer_of.pop(req.request_id), "state", state))
        if self.tracer is not None:
            self.tracer.add(PREFILL, prefill_step_name(self.steps), (t0 - self.tracer.epoch) * 1e6,
                            (time.perf_counter() - t0) * 1e6, self.steps, -1, 0,
                            self.engine.last_step_tokens)
        self._collect()
        served = pool.serve_s - served0 if pool is not None else 0.0
        self.prompt_s += time.perf_counter() - t0 - served
        return report

    def _collect(self) -> None:
        s = self.executor.sender
        s.poll()
        for o in s.done:
            if self.tracer is not None:
                self.tracer.add(KV_SEND, kv_transfer_name(o.request_id),
                                (o.t_first - self.tracer.epoch) * 1e6,
                                (o.t_done - o.t_first) * 1e6, self.steps, -1, 0, o.num_tokens)
        self.transfers += s.done
        s.done = []

    def _check_sends(self) -> None:
        """A send not complete ``timeout_s`` after its step: the decode rank is gone."""
        now = time.perf_counter()
        for o in self.executor.sender.inflight:
            if now - o.t_compute_end > self.policy.timeout_s:
                raise RankFailure(self.label, o.dests[0].rank,
                                  f"KV transfer of request {o.request_id!r}",
                                  now - o.t_compute_end)

    def stats(self) -> dict:
        """KV bytes sent and the share of transfer time hidden behind prefill compute."""
        ts = self.transfers
        window = sum(o.t_done - o.t_first for o in ts)
        exposed = sum(max(0.0, o.t_done - o.t_compute_end) for o in ts)
        return {"transfers": len(ts), "kv_bytes_sent": sum(o.nbytes for o in ts),
                "transfer_s": window, "exposed_s": exposed,
                "hidden_fraction": None if window <= 0 else 1 - exposed / window}
