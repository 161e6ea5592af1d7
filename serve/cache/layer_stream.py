"""The layer-stream cache (SwiftCache): a model holds one layer of KV locally and streams
the rest from lent memory, one layer ahead of use.

Every layer of every block lives in *remote* memory (lent by co-located engines; on a GPU
it could sit on another device). Local memory is one *layer buffer*: row ``j`` holds one
layer's K and V of one block, so local memory of M layer-blocks can serve M blocks of
context where it would hold M / layers whole blocks. Per step the blocks the batch reads
get buffer rows (their slots are renamed in the attention metadata); before layer ``i``'s
attention its rows hold layer ``i``; after it, on a copy thread, the tokens this step wrote
go back to remote memory and then layer ``i + 1`` loads, while the main thread runs layer
``i``'s output projection and MLP (the only time the buffer is not read). The step waits
for its last write-back before it ends.

On CPU the link is simulated at ``bandwidth_gbps`` (as the host tier's); on CUDA the copy
runs on its own stream. Kernels see plain per-layer caches, so every backend works.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from ...kernels.attention import gather_slots, write_kv_ref
from ...kernels.metadata import AttentionMetadata


def stream_capacity(local_layer_blocks: int, layers: int, lent_blocks: int) -> tuple[int, int]:
    """SwiftCache's capacity formula: (layer-stream blocks, regular blocks) a model with
    ``local_layer_blocks`` of local memory (counted in one-layer blocks) serves when others
    lend ``lent_blocks`` whole blocks. A streamed block costs one local layer-block (its
    buffer row) and one lent block; a regular block costs ``layers`` local layer-blocks.
    Maximum context = their sum x block size (10 layers, 100 local, 17 lent: 17 + 8 = 25
    blocks, against 100 / 10 = 10 without lending)."""
    streamed = min(lent_blocks, local_layer_blocks)
    return streamed, (local_layer_blocks - streamed) // layers


@dataclass
class StreamStats:
    layers_loaded: int = 0
    bytes_loaded: int = 0
    bytes_written_back: int = 0
    stall_seconds: float = 0.0  # the main thread waiting for a layer still on the link


class LayerStream:
    def __init__(self, remote: torch.Tensor, buffer_rows: int, bandwidth_gbps: float = 16.0):
        """``remote``: the engine's block-major KV (blocks, layers, 2, block_size, kv_heads,
        head_dim) in lent memory; ``buffer_rows``: one-layer blocks of local memory."""
        self.remote = remote
        self.layers = remote.shape[1]
        self.buffer = torch.zeros(buffer_rows, *remote.shape[2:], dtype=remote.dtype, device=remote.device)
        self.cuda = remote.device.type == "cuda"
        self.bandwidth = None if self.cuda else bandwidth_gbps * 1e9
        self.copy_stream = torch.cuda.Stream(remote.device) if self.cuda else None
        self.stats = StreamStats()
        self._blocks: torch.Tensor | None = None  # this step's blocks, in buffer-row order
        self._meta: AttentionMetadata | None = None  # this step's metadata, and renamed to buffer rows
        self._renamed: AttentionMetadata | None = None
        self._thread: threading.Thread | None = None
        self._event = None

    @property
    def buffer_rows(self) -> int:
        return self.buffer.shape[0]

    # one step -------------------------------------------------------------------------------
    def begin(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Give the step's blocks buffer rows, start loading layer 0, and return the metadata
        with every slot renamed to its buffer row."""
        bs = meta.block_size
        used = torch.cat([meta.key_slots, meta.slot_mapping[meta.slot_mapping >= 0]])
        blocks = torch.unique(torch.div(used, bs, rounding_mode="floor"))
        if len(blocks) > self.buffer_rows:
            raise RuntimeError(f"a step reads {len(blocks)} blocks; the layer buffer has {self.buffer_rows} rows")
        rename = torch.full((self.remote.shape[0],), -1, dtype=torch.long, device=blocks.device)
        rename[blocks] = torch.arange(len(blocks), device=blocks.device)

        def slots(s: torch.Tensor) -> torch.Tensor:
            return torch.where(s >= 0, rename[torch.div(s, bs, rounding_mode="floor").clamp(min=0)] * bs + s % bs, s)

        self._wait()  # a step that failed mid-way may have left a layer's copy in flight over the buffer
        self._blocks, self._meta = blocks, meta
        self._renamed = dataclasses.replace(
            meta, slot_mapping=slots(meta.slot_mapping), key_slots=slots(meta.key_slots),
            block_tables=rename[meta.block_tables.long()].clamp(min=0).to(meta.block_tables.dtype))
        self._load(0)
        return self._renamed

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V of the step's blocks (waits for its load)."""
        start = time.perf_counter()
        self._wait()
        self.stats.stall_seconds += time.perf_counter() - start
        return self.buffer[:, 0], self.buffer[:, 1]

    def done_with(self, i: int) -> None:
        """Layer ``i``'s attention has run: on the link, its new tokens go back to remote
        memory and then layer ``i + 1`` loads, both while the main thread runs the rest of
        layer ``i`` (its output projection and MLP)."""
        meta = self._meta
        written = meta.slot_mapping.index_select(0, meta.write_rows)
        back = None
        if len(written):  # gathered now: the next layer's load overwrites the buffer
            renamed = self._renamed.slot_mapping.index_select(0, meta.write_rows)
            back = (written, gather_slots(self.buffer[:, 0], renamed), gather_slots(self.buffer[:, 1], renamed))
        self._transfer(i, back, i + 1 if i + 1 < self.layers else None)

    def finish(self) -> None:
        """The step's last write-back has landed (remote memory is the step's own again)."""
        self._wait()

    # the link ---------------------------------------------------------------------------------
    def _transfer(self, i: int, back, load: int | None) -> None:
        """On the link, in order: layer ``i``'s new tokens ``back`` (slots, k, v) written to
        remote memory, then layer ``load`` read into the buffer."""
        blocks, rows = self._blocks, len(self._blocks)
        nbytes = 0
        if back is not None:
            written = 2 * back[1].numel() * back[1].element_size()
            self.stats.bytes_written_back += written
            nbytes += written
        if load is not None:
            loaded = rows * self.buffer[0].numel() * self.buffer.element_size()
            self.stats.layers_loaded += 1
            self.stats.bytes_loaded += loaded
            nbytes += loaded

        def run() -> None:
            if back is not None:
                slots, k, v = back
                write_kv_ref(self.remote[:, i, 0], self.remote[:, i, 1], k, v, slots)
            if load is not None:
                self.buffer[:rows] = self.remote[blocks, load]

        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.remote.device))  # attention is done
            with torch.cuda.stream(self.copy_stream):
                for tensor in back or ():
                    tensor.record_stream(self.copy_stream)
                run()
                self._event = torch.cuda.Event()
                self._event.record(self.copy_stream)
            return

        def simulated() -> None:
            start = time.perf_counter()
            run()
            left = nbytes / self.bandwidth - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)  # the simulated link: a lent block is not local memory

        self._thread = threading.Thread(target=simulated, name="kvshare-layer-stream", daemon=True)
        self._thread.start()

    def _load(self, i: int) -> None:
        self._transfer(i, None, i)

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._event is not None:
            torch.cuda.current_stream(self.remote.device).wait_event(self._event)
            self._event = None
