"""The host KV tier: blocks evicted from the device pool wait here to be loaded back.

A bounded pool of blocks in host memory with its own LRU index (keys are the device index's
keys, so a block loaded back is the same prefix under the same owner), and one copy thread
that runs loads while the engine computes. Each key is in one state: on host, loading (a
copy host -> device in flight), or offloading (device -> host, done at eviction time: the
device block is about to be reused, so the copy must finish first, as SGLang's write-back).
A demand load (a request waits for it) outranks a prefetch (an agent due soon).

On CUDA the host pool is pinned and copies run on their own stream. On CPU the device and
host memory are the same, so a copy is a memcpy; to keep the timing behaviour of a real
link measurable the tier holds each transfer until ``bytes / bandwidth`` has passed
(default: about a PCIe 4.0 x16 link).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

PCIE_GBPS = 25.0  # bytes per second / 1e9 of a PCIe 4.0 x16 link in practice


@dataclass
class TierStats:
    offloaded_blocks: int = 0
    loaded_blocks: int = 0  # demand loads and prefetches that landed
    prefetched_blocks: int = 0
    dropped_blocks: int = 0  # evicted from the host tier itself
    bytes_moved: int = 0  # both directions
    transfer_seconds: float = 0.0  # time the copies took (on the copy thread and at eviction)


@dataclass(order=True)
class Transfer:
    """One load back: host block -> device block."""

    priority: int  # 0 = demand, 1 = prefetch
    order: int
    key: bytes = field(compare=False)
    host_block: int = field(compare=False)
    device_block: int = field(compare=False)
    started: bool = field(default=False, compare=False)
    # on CUDA: recorded on the engine's stream when the load was asked for; the copy waits for
    # it, so it lands after every kernel already queued that reads or writes its device block
    after: object = field(default=None, compare=False)
    error: str | None = field(default=None, compare=False)  # the copy failed: nothing was loaded


class HostTier:
    def __init__(self, device_kv: torch.Tensor, num_blocks: int, bandwidth_gbps: float = PCIE_GBPS):
        """``device_kv``: the runner's block-major pool (blocks, layers, 2, block_size, kv heads,
        head dim): a block is one contiguous span, copied in one go."""
        self.device_kv = device_kv
        self.cuda = device_kv.device.type == "cuda"
        shape = list(device_kv.shape)
        shape[0] = num_blocks
        self.host_kv = torch.empty(shape, dtype=device_kv.dtype, pin_memory=self.cuda)
        self.block_bytes = device_kv[0].numel() * device_kv.element_size()
        # on CUDA the link is real; on CPU it is simulated at this rate
        self.bandwidth = None if self.cuda else bandwidth_gbps * 1e9
        self.stream = torch.cuda.Stream(device_kv.device) if self.cuda else None
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> host block, least recent first
        self.meta: dict[bytes, object] = {}  # what the block manager restores with the block
        self.free = list(range(num_blocks - 1, -1, -1))
        self.loading: dict[bytes, Transfer] = {}
        # keys about to be loaded: taking their device blocks may offload others, and a full
        # tier makes room by dropping its oldest entry, which must not be one of these
        self.kept: set[bytes] = set()
        self.stats = TierStats()
        self._queue: queue.PriorityQueue[Transfer] = queue.PriorityQueue()
        self._landed: deque[Transfer] = deque()
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._worker: threading.Thread | None = None

    @property
    def num_blocks(self) -> int:
        return self.host_kv.shape[0]

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def state(self, key: bytes) -> str | None:
        """'loading', 'host' or None (not in the tier)."""
        return "loading" if key in self.loading else "host" if key in self.index else None

    def clear(self) -> None:
        """Forget every block (after the loads in flight land: they write the device pool)."""
        while self.loading:
            self.wait(1.0)
            self.landed()
        self.index.clear()
        self.meta.clear()
        self.free = list(range(self.num_blocks - 1, -1, -1))

    def touch(self, key: bytes) -> None:
        """A hit: the key is the most recent in the host tier too."""
        if key in self.index:
            self.index.move_to_end(key)

    # device -> host -------------------------------------------------------------------------
    def offload(self, key: bytes, device_block: int, meta: object) -> bool:
        """Copy an evicted device block to the host (at once: its device block is about to be
        reused). False when every host block is busy loading."""
        if key in self.index:  # still there from an earlier trip (it was loaded back)
            self.meta[key] = meta
            self.touch(key)
            return True
        host_block = self._free_host_block()
        if host_block is None:
            return False
        start = time.perf_counter()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device_kv.device))  # the KV is written
            with torch.cuda.stream(self.stream):
                self.host_kv[host_block].copy_(self.device_kv[device_block], non_blocking=True)
            self.stream.synchronize()
        else:
            self.host_kv[host_block].copy_(self.device_kv[device_block])
        self._hold_for_link(start)
        self.index[key], self.meta[key] = host_block, meta
        with self._cond:  # the copy thread adds to the same figures
            self.stats.offloaded_blocks += 1
            self.stats.bytes_moved += self.block_bytes
            self.stats.transfer_seconds += time.perf_counter() - start
        return True

    def _free_host_block(self) -> int | None:
        if self.free:
            return self.free.pop()
        victim = next((k for k in self.index if k not in self.loading and k not in self.kept), None)
        if victim is None:
            return None
        self.meta.pop(victim, None)
        self.stats.dropped_blocks += 1
        return self.index.pop(victim)

    # host -> device ---------------------------------------------------------------------------
    def load(self, key: bytes, device_block: int, demand: bool) -> None:
        """Start copying ``key`` into ``device_block`` on the copy thread."""
        transfer = Transfer(0 if demand else 1, next(self._order), key, self.index[key], device_block,
                            after=self._engine_stream_mark())
        with self._cond:
            self.loading[key] = transfer
        self.touch(key)
        self._ensure_worker()
        self._queue.put(transfer)

    def promote(self, key: bytes) -> None:
        """A request now waits for a prefetch that has not started: make it a demand load."""
        with self._cond:
            current = self.loading.get(key)
            if current is None or current.started or current.priority == 0:
                return
            # the queued prefetch entry goes stale: the worker only runs the key's current entry
            self.loading[key] = Transfer(0, next(self._order), key, current.host_block, current.device_block,
                                         after=current.after)
        self._queue.put(self.loading[key])

    def _engine_stream_mark(self):
        """A CUDA event on the engine's current stream: the device block a load is about to
        fill may still be read or written by the last step's kernels (its blocks freed by an
        abort or a preemption between steps, a step of prompt chunks that ended with no sync)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device_kv.device))
        return event

    def landed(self) -> list[Transfer]:
        """Loads that finished since the last call (called by the engine thread each step),
        failed ones too (``error`` set): their keys leave the tier, to be recomputed."""
        with self._cond:
            done, self._landed = list(self._landed), deque()
            for transfer in done:
                del self.loading[transfer.key]
                if transfer.error is not None and self.index.get(transfer.key) == transfer.host_block:
                    del self.index[transfer.key]
                    self.meta.pop(transfer.key, None)
                    self.free.append(transfer.host_block)
        return done

    def wait(self, timeout: float) -> None:
        """Block until a load lands (or ``timeout``): nothing else can run meanwhile."""
        with self._cond:
            if not self._landed and self.loading:
                self._cond.wait(timeout)

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="kvshare-host-tier", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            current = self._queue.get()
            with self._cond:
                if self.loading.get(current.key) is not current:
                    continue  # the stale entry of a promoted prefetch
                current.started = True
            start = time.perf_counter()
            try:
                self._copy_in(current)
            except Exception as exc:  # the thread must live on, and the request waiting must hear of it
                current.error = f"{type(exc).__name__}: {exc}"
                log.warning("kvshare: loading a KV block back from the host failed (%s); it is recomputed",
                            current.error)
            else:
                self._hold_for_link(start)
            with self._cond:
                if current.error is None:
                    self.stats.loaded_blocks += 1
                    self.stats.prefetched_blocks += current.priority
                    self.stats.bytes_moved += self.block_bytes
                    self.stats.transfer_seconds += time.perf_counter() - start
                self._landed.append(current)
                self._cond.notify_all()

    def _copy_in(self, transfer: Transfer) -> None:
        """Host block -> device block, finished when this returns."""
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(transfer.after)  # the engine's earlier kernels are done with the block
                self.device_kv[transfer.device_block].copy_(self.host_kv[transfer.host_block], non_blocking=True)
            self.stream.synchronize()
        else:
            self.device_kv[transfer.device_block].copy_(self.host_kv[transfer.host_block])

    def _hold_for_link(self, start: float) -> None:
        """On CPU: let the copy take as long as the simulated link would."""
        if self.bandwidth:
            remaining = start + self.block_bytes / self.bandwidth - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
