"""The worker-side half of the connector: one aiohixl rank per vLLM worker process.

The rank's agent runs on its own thread and event loop (an Agent belongs to one loop); the
forward thread hands it work with ``call_soon_threadsafe`` and never waits on it inside the
forward. Prefill: ``save_kv_layer`` posts the layer's completed pages with one ``put_many``
per destination; ``wait_for_save`` waits for the step's puts (they ran while later layers
computed), then sends DONE, which the target yields only once every byte is in place.
Decode: announces its blocks (REG) and reports the request received on DONE. Nothing of a
put reads prefill memory past the step that posted it, except pushes from blocks a finished
request holds until ``finished_sending`` (vLLM reuses freed blocks between steps).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohixl

from ...errors import HixlError, InvalidArgument
from ...remote import RemoteRegion, RemoteSlice
from ._config import Layout, Settings, group_name, parse_group
from ._messages import decode as decode_message
from ._messages import encode as encode_message
from ._messages import runs, unruns
from ._meta import AiohixlMetadata, Registration, Skip
from ._trace import Trace

log = logging.getLogger("vllm.aiohixl")
T = TypeVar("T")


class IncompatiblePeer(InvalidArgument):
    """The other instance's KV layout differs: raw page copies between them would be garbage."""


@dataclass
class Dest:
    """Where a transfer's pages go: a decode worker's blocks, as its REG said."""

    rank: int
    req_id: str
    first_block: int
    block_ids: list[int]
    layer_offsets: list[int]
    kv: RemoteRegion | RemoteSlice
    peer: aiohixl.Peer
    arrived: float


@dataclass
class Job:
    """A prefill request with a decode destination, as this worker sees it."""

    transfer_id: str
    req_id: str
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    pushed_upto: int = 0  # prompt blocks below this index went out
    final: bool = False  # its last prompt chunk was computed
    final_at: float = 0.0
    state: str = "open"  # open | done | failed | cancelled | skipped
    claimed: bool = False
    inflight: list[asyncio.Future[Any]] = field(default_factory=list)
    first_put: bool = False
    nbytes: int = 0


@dataclass
class Pending:
    """A decode request waiting for its KV."""

    transfer_id: str
    req_id: str
    targets: set[int]
    deadline: float
    claimer: tuple[int, bytes] | None = None
    cancelling: bool = False


class LoopThread:
    """An event loop on a daemon thread, bound to ``cpus`` (the forward thread's OMP binding is inherited)."""

    def __init__(self, name: str, cpus: tuple[int, ...] | None) -> None:
        self.loop = asyncio.new_event_loop()
        self._cpus = cpus
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _name_os_thread(self._thread.name)
        cpus = self._cpus if self._cpus is not None else tuple(range(os.cpu_count() or 1))
        try:
            os.sched_setaffinity(0, cpus)
        except (OSError, ValueError) as exc:
            log.warning("aiohixl: cannot bind the connector thread to CPUs %s: %s", cpus, exc)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class WorkerSide:
    def __init__(self, settings: Settings, engine_id: str, producer: bool, tp_rank: int, block_size: int) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.producer = producer
        self.role = "P" if producer else "D"
        self.tp_rank = tp_rank
        self.block_size = block_size
        self.rank = settings.rank_base + tp_rank
        self.trace = Trace(settings.trace, engine_id, "prefill" if producer else "decode")
        self._lock = threading.Lock()
        self._thread: LoopThread | None = None
        self._ctx: aiohixl.Context | None = None
        self._layout: Layout | None = None
        self._layer_index: dict[str, int] = {}
        self._offsets: list[int] = []
        self._page = 0
        self._kv_region: aiohixl.Region | None = None
        # prefill
        self._jobs: dict[str, Job] = {}
        self._dests: dict[str, Dest] = {}
        self._skipped: dict[str, float] = {}
        self._tombstones: dict[str, float] = {}
        self._finished_reqs: set[str] = set()
        self._registered: set[str] = set()  # for the scheduler: REG or SKIP arrived
        self._plan: list[tuple[Job, Dest, list[tuple[int, int]]]] = []
        self._finals: list[Job] = []
        self._step_puts: list[asyncio.Future[Any]] = []
        # decode
        self._pending: dict[str, Pending] = {}
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._watch_wake: asyncio.Event | None = None

    # ---- startup ----

    def register_kv_caches(self, kv_caches: dict[str, Any], layout: Layout) -> None:
        import torch

        names = list(kv_caches)
        first = kv_caches[names[0]]
        storage = first.untyped_storage()
        base = storage.data_ptr()
        page = first.stride(0) * first.element_size()
        for name in names:
            t = kv_caches[name]
            if t.untyped_storage().data_ptr() != base or not t.is_contiguous():
                raise InvalidArgument(
                    f"AiohixlConnector: layer {name}'s KV cache is not a contiguous view of the one allocation"
                    " this connector registers (CPU layout LBHNC expected)"
                )
            if t.stride(0) * t.element_size() != page:
                raise InvalidArgument(f"AiohixlConnector: layer {name} has another page size than {names[0]}")
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._offsets = [kv_caches[n].data_ptr() - base for n in names]
        self._page = page
        self._layout = layout
        # A fresh tensor on the same storage: aiohixl pins it, vLLM's views stay as they are.
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._thread = LoopThread(f"aiohixl-{self.role}{self.tp_rank}", self.settings.loop_cpus)
        self._thread.run(self._start(whole), timeout=120)

    async def _start(self, whole: Any) -> None:
        s = self.settings
        assert self._layout is not None
        group = group_name(self.role, self.engine_id, self._layout)
        ctx = await aiohixl.init(
            rank=self.rank,
            group=group,
            store=s.store,
            token=s.token,
            listen=s.listen,
            namespace=s.namespace,
            transports=s.transports,
            copy_threads=s.copy_threads,
        )
        self._ctx = ctx
        try:
            self._check_peers()
            if self.producer:
                self._kv_region = ctx.register(whole, access="none")
            else:
                self._kv_region = ctx.register(whole, access="remote_write", name="kv")
            await ctx.store.flush("AiohixlConnector")
        except BaseException:
            await ctx.aclose()
            raise
        self._watch_wake = asyncio.Event()
        asyncio.get_running_loop().create_task(self._reader())
        if not self.producer:
            asyncio.get_running_loop().create_task(self._watch_prefill_ranks())
        log.info("aiohixl: %s worker %d is rank %d in %s (%s)", self.role, self.tp_rank, self.rank, s.store, group)

    def _check_peers(self) -> None:
        """Refuse to start beside an instance of the other role whose KV layout differs."""
        assert self._ctx is not None and self._layout is not None
        mine = self._layout.key()
        for rec in self._ctx.store.records.values():
            g = parse_group(rec.group)
            if g is None or g[0] == self.role or g[2] == mine:
                continue
            raise IncompatiblePeer(f"AiohixlConnector: {_describe_mismatch(self.role, mine, g)}")

    # ---- prefill: per step ----

    def bind(self, meta: AiohixlMetadata) -> None:
        if self.producer:
            self._plan_step(meta)
        else:
            self._announce(meta.registrations, meta.skips)

    def _plan_step(self, meta: AiohixlMetadata) -> None:
        thread = self._thread
        assert thread is not None
        if meta.aborted:
            thread.loop.call_soon_threadsafe(self._on_aborted, list(meta.aborted))
        if not meta.sends:
            return
        bs = self.block_size
        plan: list[tuple[Job, Dest, list[tuple[int, int]]]] = []
        finals: list[Job] = []
        with self._lock:
            for step in meta.sends:
                job = self._jobs.get(step.transfer_id)
                if job is None:
                    job = self._jobs[step.transfer_id] = Job(step.transfer_id, step.req_id, step.num_prompt_tokens)
                    if step.transfer_id in self._skipped:
                        job.state = "skipped"
                job.block_ids = step.block_ids
                if step.final:
                    finals.append(job)
                dest = self._dests.get(step.transfer_id)
                if dest is None or job.state != "open":
                    continue
                end = -(-step.num_prompt_tokens // bs) if step.final else (step.num_computed + step.num_scheduled) // bs
                start = max(job.pushed_upto, dest.first_block)
                if end > start:
                    plan.append((job, dest, _block_pairs(job, dest, start, end)))
                    job.pushed_upto = end
        self._plan, self._finals = plan, finals

    def save_kv_layer(self, layer_name: str) -> None:
        if self._plan and self.settings.layerwise:
            assert self._thread is not None
            self._thread.loop.call_soon_threadsafe(self._post_layers, self._plan, (self._layer_index[layer_name],))

    def _post_layers(self, plan: list[tuple[Job, Dest, list[tuple[int, int]]]], layers: tuple[int, ...]) -> None:
        """On the loop: one put_many per job for ``layers`` of its planned blocks."""
        assert self._kv_region is not None
        local = self._kv_region
        page = self._page
        for job, dest, blocks in plan:
            if job.state != "open":
                continue
            pairs = []
            for layer in layers:
                lo, ro = self._offsets[layer], dest.layer_offsets[layer]
                for d_blk, p_blk, count in _runs(blocks):
                    n = count * page
                    pairs.append(
                        (
                            dest.kv[ro + d_blk * page : ro + d_blk * page + n],
                            local[lo + p_blk * page : lo + p_blk * page + n],
                        )
                    )
            if not job.first_put:
                job.first_put = True
                self.trace.event("first_put", job.transfer_id, job.req_id)
            job.nbytes += sum(len(p[1]) for p in pairs)
            fut = asyncio.ensure_future(dest.peer.put_many(pairs))
            job.inflight.append(fut)
            self._step_puts.append(fut)

    def wait_for_save(self) -> None:
        plan, finals = self._plan, self._finals
        if not plan and not finals:
            return
        self._plan, self._finals = [], []
        for job in finals:
            self.trace.event("forward_end", job.transfer_id, job.req_id)
        assert self._thread is not None
        try:
            self._thread.run(self._finish_step(plan, finals), self.settings.save_timeout_s)
        except concurrent.futures.TimeoutError:
            # Puts still reading blocks vLLM may reuse next step: break the paths they take.
            log.error(
                "aiohixl: this step's KV puts did not finish in %.0f s: closing their peers",
                self.settings.save_timeout_s,
            )
            self._thread.run(self._break(plan), 30)

    async def _finish_step(self, plan: list[tuple[Job, Dest, list[tuple[int, int]]]], finals: list[Job]) -> None:
        if not self.settings.layerwise and plan:
            self._post_layers(plan, tuple(range(len(self._offsets))))
        puts, self._step_puts = self._step_puts, []
        if puts:
            await asyncio.gather(*puts, return_exceptions=True)
        for job, dest, _ in plan:
            error = _first_error(job.inflight)
            job.inflight = [f for f in job.inflight if not f.done()]
            if error is not None and job.state == "open":
                await self._fail(job, dest, f"a put into decode rank {dest.rank} failed: {error}")
            elif not job.claimed and job.state == "open":
                job.claimed = True
                await self._send(dest.peer, encode_message("CLAIM", job.transfer_id, rank=self.rank))
        now = time.monotonic()
        for job in finals:
            # Final only now that its last chunk is in memory: a REG arriving from here on
            # pushes the rest at once (below, or in _on_registration).
            with self._lock:
                job.final, job.final_at = True, now
                late = self._dests.get(job.transfer_id)
            if late is not None and job.state == "open":
                await self._push_rest(job, late)

    async def _send_done(self, job: Job, dest: Dest) -> None:
        self.trace.event("last_put_done", job.transfer_id, job.req_id, job.nbytes)
        if await self._send(dest.peer, encode_message("DONE", job.transfer_id)):
            job.state = "done"
            self.trace.event("done_sent", job.transfer_id, job.req_id, job.nbytes)
        else:
            job.state = "failed"
        self._dests.pop(job.transfer_id, None)

    async def _fail(self, job: Job, dest: Dest, why: str) -> None:
        log.warning("aiohixl: transfer %s (request %s) failed: %s", job.transfer_id, job.req_id, why)
        job.state = "failed"
        self._dests.pop(job.transfer_id, None)
        await self._send(dest.peer, encode_message("FAIL", job.transfer_id, why=why))

    async def _break(self, plan: list[tuple[Job, Dest, list[tuple[int, int]]]]) -> None:
        for job, dest, _ in plan:
            job.state = "failed"
            await dest.peer.aclose()
        await asyncio.gather(*self._step_puts, return_exceptions=True)
        self._step_puts = []

    async def _push_rest(self, job: Job, dest: Dest) -> None:
        """After the last chunk: the prompt blocks not pushed yet (REG came late) in one put_many, then DONE.

        The request's blocks stay allocated until finished_sending reports it (delay_free)."""
        end = -(-job.num_prompt_tokens // self.block_size)
        start = max(job.pushed_upto, dest.first_block)
        if end > start:
            job.pushed_upto = end
            plan = [(job, dest, _block_pairs(job, dest, start, end))]
            self._post_layers(plan, tuple(range(len(self._offsets))))
            puts, self._step_puts = self._step_puts, []
            await asyncio.gather(*puts, return_exceptions=True)
            error = _first_error(job.inflight)
            job.inflight = []
            if error is not None:
                await self._fail(job, dest, f"a put into decode rank {dest.rank} failed: {error}")
                return
        await self._send_done(job, dest)

    def _on_aborted(self, transfer_ids: list[str]) -> None:
        for t in transfer_ids:
            with self._lock:
                job = self._jobs.pop(t, None)
            self._tombstones[t] = time.monotonic()
            dest = self._dests.pop(t, None)
            if dest is not None:
                asyncio.ensure_future(
                    self._send(dest.peer, encode_message("ABORT", t, why="the prefill request was aborted"))
                )
            if job is not None:
                job.state = "cancelled"

    def take_registered(self) -> set[str]:
        if not self._registered:
            return set()
        with self._lock:
            out, self._registered = self._registered, set()
        return out

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step."""
        if self.producer:
            return self._finished_sending(finished_req_ids), set(), set()
        return set(), *self._finished_recving(finished_req_ids)

    def _finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        if not self._jobs:
            return set()
        now = time.monotonic()
        out: set[str] = set()
        with self._lock:
            self._finished_reqs |= finished_req_ids & {job.req_id for job in self._jobs.values()}
            for t, job in list(self._jobs.items()):
                if job.final and job.state == "open" and now - job.final_at > self.settings.registration_timeout_s:
                    log.warning(
                        "aiohixl: no decode registration for transfer %s within %.0f s: freeing its blocks",
                        t,
                        self.settings.registration_timeout_s,
                    )
                    job.state = "failed"
                    self._tombstones[t] = now
                if job.final and job.state != "open" and job.req_id in self._finished_reqs and not job.inflight:
                    out.add(job.req_id)
                    self._finished_reqs.discard(job.req_id)
                    del self._jobs[t]
        return out

    # ---- decode ----

    def _announce(self, regs: list[Registration], skips: list[Skip]) -> None:
        if not regs and not skips:
            return
        deadline = time.monotonic() + self.settings.registration_timeout_s
        with self._lock:
            for r in regs:
                self._pending[r.transfer_id] = Pending(r.transfer_id, r.req_id, set(), deadline)
        assert self._thread is not None
        self._thread.submit(self._send_registrations(regs, skips))

    def _prefill_ranks(self, engine: str | None) -> list[int]:
        """The prefill workers of our tensor-parallel rank: of ``engine``, or of every prefill instance."""
        assert self._ctx is not None
        by_engine: dict[str, list[int]] = {}
        for rank, rec in self._ctx.store.records.items():
            g = parse_group(rec.group)
            if g is not None and g[0] == "P" and (engine is None or g[1] == engine):
                by_engine.setdefault(g[1], []).append(rank)
        return [sorted(ranks)[self.tp_rank] for ranks in by_engine.values() if len(ranks) > self.tp_rank]

    async def _send_registrations(self, regs: list[Registration], skips: list[Skip]) -> None:
        assert self._layout is not None
        for s in skips:
            for rank in self._prefill_ranks(s.remote_engine_id):
                await self._notify(rank, encode_message("SKIP", s.transfer_id))
        for r in regs:
            msg = encode_message(
                "REG",
                r.transfer_id,
                rank=self.rank,
                req=r.req_id,
                first=r.first_block,
                n=r.num_prompt_tokens,
                blocks=runs(r.block_ids),
                offsets=self._offsets,
                layout=self._layout.key(),
            )
            targets = self._prefill_ranks(r.remote_engine_id)
            sent = {rank for rank in targets if await self._notify(rank, msg)}
            with self._lock:
                p = self._pending.get(r.transfer_id)
                if p is not None:
                    p.targets = sent
            if not sent:
                engine = r.remote_engine_id or "any prefill instance"
                self._fail_pending(
                    r.transfer_id, f"no prefill worker of {engine} is reachable in {self.settings.store}"
                )

    async def _notify(self, rank: int, data: bytes) -> bool:
        assert self._ctx is not None
        if rank not in self._ctx.store.records:
            return False  # gone: waiting for it to come back would hold up every other message
        try:
            await self._ctx.notify(rank, data, timeout=10)
            return True
        except (HixlError, OSError) as exc:
            log.warning("aiohixl: cannot notify rank %d: %s", rank, exc)
            return False

    def _fail_pending(self, t: str, why: str) -> None:
        with self._lock:
            p = self._pending.pop(t, None)
            if p is None:
                return
            self._failed.add(p.req_id)
        log.warning("aiohixl: KV of request %s (transfer %s) will not arrive: %s", p.req_id, t, why)

    def _finished_recving(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self._pending:
            now = time.monotonic()
            cancel: list[Pending] = []
            with self._lock:
                for p in self._pending.values():
                    if not p.cancelling and (p.req_id in finished_req_ids or now > p.deadline):
                        p.cancelling = True
                        cancel.append(p)
            if cancel:
                assert self._thread is not None
                for p in cancel:
                    self._thread.submit(self._cancel(p, aborted=p.req_id in finished_req_ids))
        if not self._done and not self._failed:
            return set(), set()
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done | failed, failed

    async def _cancel(self, p: Pending, aborted: bool) -> None:
        """Free a waiting request's blocks only once no prefill worker can still write into them."""
        why = (
            "the decode request was aborted"
            if aborted
            else (f"its KV did not arrive within {self.settings.registration_timeout_s:.0f} s")
        )
        msg = encode_message("CANCEL", p.transfer_id, rank=self.rank)
        for rank in list(p.targets):
            if not await self._notify(rank, msg):
                p.targets.discard(rank)  # unreachable: it writes nothing more
        deadline = time.monotonic() + self.settings.cancel_timeout_s
        wake = self._watch_wake
        assert wake is not None
        while True:
            wake.clear()  # before looking: an answer from here on wakes the wait
            left = deadline - time.monotonic()
            if not p.targets or p.transfer_id not in self._pending or left <= 0:
                break
            try:
                await asyncio.wait_for(wake.wait(), left)
            except asyncio.TimeoutError:
                break
        self._fail_pending(p.transfer_id, why)

    async def _watch_prefill_ranks(self) -> None:
        """A prefill worker that left the store (or restarted) will not finish what it claimed."""
        assert self._ctx is not None
        store = self._ctx.store

        def gone() -> list[tuple[str, int]] | None:
            out = []
            for t, p in list(self._pending.items()):
                if p.claimer is not None:
                    rec = store.records.get(p.claimer[0])
                    if rec is None or rec.agent_id != p.claimer[1]:
                        out.append((t, p.claimer[0]))
            return out or None

        while True:
            try:
                lost = await store.wait_for("AiohixlConnector", gone, None)
            except HixlError as exc:
                if not store.closed:  # closed: we are shutting down
                    log.error("aiohixl: the rank store is gone (%s): waiting requests fail by their deadline", exc)
                return
            for t, rank in lost or ():
                self._fail_pending(t, f"prefill rank {rank} left the store (its process ended) mid-transfer")

    # ---- notifications ----

    async def _reader(self) -> None:
        assert self._ctx is not None
        async for note in self._ctx.agent.notifications():
            msg = decode_message(note.data)
            if msg is None:
                continue
            try:
                if self.producer:
                    await self._on_prefill_message(msg)
                else:
                    self._on_decode_message(msg)
            except (HixlError, OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("aiohixl: message %s for transfer %s: %s", msg.get("op"), msg.get("t"), exc)

    def _on_decode_message(self, msg: dict[str, Any]) -> None:
        t, op = msg["t"], msg["op"]
        if op == "DONE":
            with self._lock:
                p = self._pending.pop(t, None)
                if p is not None:
                    self._done.add(p.req_id)
            if p is not None:
                self.trace.event("done_received", t, p.req_id)
        elif op in ("FAIL", "ABORT"):
            self._fail_pending(t, f"the prefill worker says: {msg.get('why', op)}")
        elif op == "CLAIM":
            p = self._pending.get(t)
            rank = int(msg["rank"])
            assert self._ctx is not None
            rec = self._ctx.store.records.get(rank)
            if p is not None and rec is not None:
                p.claimer = (rank, rec.agent_id)
                assert self._watch_wake is not None
                self._watch_wake.set()
        elif op == "CANCELLED":
            p = self._pending.get(t)
            if p is not None:
                p.targets.discard(int(msg["rank"]))
                assert self._watch_wake is not None
                self._watch_wake.set()

    async def _on_prefill_message(self, msg: dict[str, Any]) -> None:
        t, op = msg["t"], msg["op"]
        if op == "REG":
            await self._on_registration(t, msg)
        elif op == "SKIP":
            self._skipped[t] = time.monotonic()
            with self._lock:
                self._registered.add(t)
                job = self._jobs.get(t)
                if job is not None and job.state == "open":
                    job.state = "skipped"
        elif op == "CANCEL":
            rank = int(msg.get("rank", -1))
            with self._lock:
                job = self._jobs.get(t)
                if job is not None and job.state == "open":
                    job.state = "cancelled"
            self._tombstones[t] = time.monotonic()
            dest = self._dests.pop(t, None)
            if job is not None and job.inflight:
                await asyncio.gather(*job.inflight, return_exceptions=True)
            peer_rank = dest.rank if dest is not None else rank
            if peer_rank >= 0:
                await self._notify(peer_rank, encode_message("CANCELLED", t, rank=self.rank))

    async def _on_registration(self, t: str, msg: dict[str, Any]) -> None:
        assert self._ctx is not None and self._layout is not None
        now = time.monotonic()
        self._gc(now)
        d_rank = int(msg["rank"])
        if t in self._tombstones:
            await self._notify(d_rank, encode_message("ABORT", t, why="the prefill request was aborted or timed out"))
            return
        if msg.get("layout") != self._layout.key():
            why = _describe_mismatch("P", self._layout.key(), ("D", "?", str(msg.get("layout"))))
            await self._notify(d_rank, encode_message("FAIL", t, why=why))
            return
        kv = await self._ctx.get_remote_mem(d_rank, name="kv", timeout=10)
        peer = await self._ctx.peer(d_rank)
        offsets = [int(o) for o in msg["offsets"]]
        blocks = unruns(msg["blocks"])
        if len(offsets) != len(self._offsets) or any(o < 0 or o + self._page > kv.nbytes for o in offsets):
            await self._notify(d_rank, encode_message("FAIL", t, why="the decode worker's KV layout does not match"))
            return
        num_blocks = (kv.nbytes - max(offsets)) // self._page
        n = int(msg["n"])
        if int(msg["first"]) + len(blocks) != -(-n // self.block_size) or any(not 0 <= b < num_blocks for b in blocks):
            await self._notify(d_rank, encode_message("FAIL", t, why="block ids out of the decode worker's KV cache"))
            return
        dest = Dest(d_rank, str(msg["req"]), int(msg["first"]), blocks, offsets, kv, peer, now)
        with self._lock:
            self._dests[t] = dest
            self._registered.add(t)
            job = self._jobs.get(t)
        if job is None:
            return
        if job.state == "skipped":
            return
        if int(msg.get("n", job.num_prompt_tokens)) != job.num_prompt_tokens:
            await self._fail(job, dest, f"decode has {msg.get('n')} prompt tokens, prefill {job.num_prompt_tokens}")
            return
        if not job.claimed:
            job.claimed = True
            await self._send(peer, encode_message("CLAIM", t, rank=self.rank))
        if job.final and job.state == "open":
            await self._push_rest(job, dest)

    def _gc(self, now: float) -> None:
        """Forget registrations and tombstones no request here will claim (other prefill instances' ones)."""
        ttl = 2 * self.settings.registration_timeout_s
        for table in (self._skipped, self._tombstones):
            for t in [t for t, at in table.items() if now - at > ttl]:
                del table[t]
        with self._lock:
            stale = [t for t, d in self._dests.items() if now - d.arrived > ttl and t not in self._jobs]
            for t in stale:
                del self._dests[t]

    async def _send(self, peer: aiohixl.Peer, data: bytes) -> bool:
        try:
            await peer.notify(data, timeout=10)
            return True
        except HixlError as exc:
            log.warning("aiohixl: cannot notify %s: %s", peer.name, exc)
            return False

    # ---- shutdown ----

    def shutdown(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        ctx = self._ctx
        if ctx is not None:
            try:
                thread.run(ctx.aclose(), 10)
            except (concurrent.futures.TimeoutError, HixlError, OSError) as exc:
                log.warning("aiohixl: closing the connector's rank: %s", exc)
        thread.stop()
        self.trace.close()


def _name_os_thread(name: str) -> None:
    """Name this thread for the OS too (top -H, /proc: how the bench tells the connector's CPU apart)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _block_pairs(job: Job, dest: Dest, start: int, end: int) -> list[tuple[int, int]]:
    """(decode block, prefill block) for prompt blocks [start, end)."""
    return [(dest.block_ids[j - dest.first_block], job.block_ids[j]) for j in range(start, end)]


def _runs(blocks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(decode block, prefill block, count): consecutive on both sides become one copy."""
    out: list[tuple[int, int, int]] = []
    for d, p in blocks:
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == p:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, p, 1))
    return out


def _first_error(futures: list[asyncio.Future[Any]]) -> BaseException | None:
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            return f.exception()
    return None


def _describe_mismatch(role: str, mine: str, other: tuple[str, str, str]) -> str:
    a = dict(kv.split("=", 1) for kv in mine.split(",") if "=" in kv)
    b = dict(kv.split("=", 1) for kv in other[2].split(",") if "=" in kv)
    diff = ", ".join(f"{k}: {a.get(k)} here, {b.get(k)} there" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
    kind = "prefill" if role == "P" else "decode"
    peer = "decode" if role == "P" else "prefill"
    return (
        f"this {kind} instance and {peer} instance {other[1]!r} have different KV layouts ({diff or other[2]}):"
        " start both with the same model, dtype, --block-size and tensor-parallel size"
    )
