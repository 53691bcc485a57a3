"""``GpuEngine``: the full encode (added tokens, pre-tokenization, BPE) on a CUDA device.

Request path (host work is O(n) memcpy-speed NumPy/regex; everything per position runs on the device)::

    text -> NFC check (NFC files only; else the CPU engine, counted)    tables.GpuTables.accepts
         -> UTF-8 bytes + added-token spans (leftmost-longest)          tables.AddedSplitter (host regex)
         -> pinned staging -> device: one fixed launch sequence per size class, counts on the device
              decode -> scan -> scatter (code points, class bits) -> added spans -> run markers -> scans
              -> family predicate -> scan (pre-token ids) -> classify (added / ignore_merges hit /
              warp list / block list) -> BPE warp + block kernels -> scan (token offsets) -> gather
         -> one D2H of the counts (the only sync), one D2H of the ids

Size classes (capacity in bytes, powers of 4 from 4 KiB) each hold preallocated buffers, so a small
request never pays for the largest; with CuPy installed each class's launch sequence is captured once
as a CUDA graph (``use_graphs``), otherwise the kernels are launched directly. Not thread-safe: one
request at a time per engine (``routing.GpuRouter`` serializes and applies backpressure).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
from numba import cuda

from toktier_backend.engines.protocol import Engine
from toktier_backend.errors import EngineUnavailable, UnsupportedTokenizer
from toktier_backend.gpu import _warp as W_
from toktier_backend.gpu import kernels as K
from toktier_backend.gpu import unicode_tables as ut
from toktier_backend.gpu.merges import WARP_MAX, k_bpe_block, k_bpe_warp
from toktier_backend.gpu.tables import GpuTables

log = logging.getLogger(__name__)

MIN_CLASS = 1 << 12
DEFAULT_MAX_BYTES = 1 << 26


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _SizeClass:
    """Preallocated device and pinned buffers for texts of up to ``cap`` UTF-8 bytes."""

    def __init__(self, cap: int, max_spans: int):
        self.cap = C = cap
        self.max_spans = max_spans
        da = cuda.device_array
        i32 = np.int32
        self.bts = da(C, np.uint8)
        self.counts = da(K.N_COUNTS, i32)
        self.added = da((max_spans, 3), i32)
        self.lead = da((1, C + 1), i32)
        self.cps = da(C + 1, i32)
        self.cpbyte = da(C + 2, i32)
        self.cls = da(C + 1, i32)
        self.seg = da(C + 1, i32)
        self.addid = da(C + 1, i32)
        self.fwd = da((K.N_FWD, C + 1), i32)
        self.rev = da((K.N_REV, C + 1), i32)
        self.start = da((1, C + 1), i32)
        self.ptidx = da((1, C + 1), i32)
        self.pt_b0 = da(C + 2, i32)
        self.pt_aid = da(C + 1, i32)
        self.sym = da(C + 1, i32)
        # BPE scratch reuses the scan channels (free once the predicate has run)
        self.tmp, self.rk, self.nw, self.sel = self.fwd[0], self.fwd[1], self.fwd[2], self.fwd[3]
        self.ntok = da((1, C + 1), i32)
        self.tokoff = da((1, C + 1), i32)
        self.shortlist = da(C + 1, i32)
        self.longlist = da(C + 1, i32)
        self.out = da(C + 1, i32)
        self.bstarts = da(max_spans, i32)
        self.boffs = da(max_spans, i32)
        # launch geometry, sized by capacity
        self.ew = (2, W_.BLOCK) if W_.SIM else (min(_cdiv(C, W_.BLOCK), 2048), W_.BLOCK)
        sb = 2 if W_.SIM else max(1, min(256, _cdiv(C, W_.BLOCK * 8)))
        self.scan_grid = (sb, W_.BLOCK)
        self.agg = da((max(K.N_FWD, K.N_REV), sb * W_.BLOCK), i32)
        self.warp_grid = (2, 32) if W_.SIM else (max(1, min(_cdiv(C, 4 * 8), 4096)), 32 * W_.WARPS_PER_BLOCK)
        self.block_grid = (1, W_.BLOCK) if W_.SIM else (64, W_.BLOCK)
        # pinned host staging
        self.h_bts = cuda.pinned_array(C, np.uint8)
        self.h_counts = cuda.pinned_array(K.N_COUNTS, i32)
        self.h_added = cuda.pinned_array((max_spans, 3), i32)
        self.h_out = cuda.pinned_array(C + 1, i32)
        self.h_bstarts = cuda.pinned_array(max_spans, i32)
        self.h_boffs = cuda.pinned_array(max_spans, i32)
        self.graph = None


class GpuEngine:
    """Full encode on a CUDA device (numba kernels), behind the ``DeviceEngine`` protocol
    (``engines/protocol.py``): one request at a time (:attr:`releases_gil` is ``False``: never chunked onto
    threads), ``str`` only.

    Args:
        path: a tokenizer.json whose family has a parallel predicate (gpt2, cl100k/Llama 3, Qwen2/3,
            DeepSeek-V3; see ``tables.detect_gpu_family``).
        cpu: engine for texts the GPU path does not accept (NFC files: texts where NFC is not the
            identity); default the HF reference. Every such request is counted in ``stats``.
        use_graphs: capture each size class as a CUDA graph (needs CuPy); ``None`` = when available.
        max_bytes: largest request (UTF-8 bytes) taken on the device.

    Raises:
        EngineUnavailable: no CUDA device (and not the simulator), or the file is not supported.

    Example: gpt2, ``encode("hello world").tolist() == [31373, 995]`` (HF
    ``encode("hello world", add_special_tokens=False).ids``).
    """

    name = "gpu"
    releases_gil = False
    accepts_utf8 = False

    def __init__(self, path: str, *, cpu: Engine | None = None, use_graphs: bool | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        import numba

        self.version = f"0.1+numba{numba.__version__}"
        if not W_.SIM and not cuda.is_available():
            raise EngineUnavailable("engine 'gpu': no CUDA device is available (numba.cuda.is_available() is False)")
        try:
            self.tables = GpuTables.from_file(path)
        except UnsupportedTokenizer as e:
            raise EngineUnavailable(f"engine 'gpu' cannot serve {path!r}: {e}") from e
        self.path = str(path)
        self._cpu = cpu
        self.max_bytes = max_bytes
        self.stats = {"gpu": 0, "cpu_not_accepted": 0, "cpu_too_large": 0, "graph_launches": 0}
        self._lock = threading.Lock()
        self._classes: dict[int, _SizeClass] = {}
        self._stage_events = None
        self._min_added = min((len(b) for b in self.tables.added.ids), default=1)
        t = self.tables
        to = cuda.to_device
        self._ctab = to(ut.class_table())
        self._ftab = to(ut.fold_table())
        self._byte_ids = to(t.byte_ids)
        self._mk = [to(t.mk_a), to(t.mk_b), to(t.m_rank), to(t.m_new)]
        self._vh = [to(t.vh_key), to(t.vh_id), to(t.blob), to(t.boff), to(t.item_ids)]
        self._nfwd = {0: 0, 1: 3, 2: 1, 3: 5}[t.family_code]
        if use_graphs is None:
            use_graphs = not W_.SIM and _cupy() is not None
        self.use_graphs = bool(use_graphs)
        self._stream = cuda.stream()
        #: Set ``time_device = True`` to record CUDA events around each device pass: ``last_device_ms``
        #: (whole launch sequence) and, without graphs, ``last_stage_ms`` (per stage).
        self.time_device = False
        self.last_device_ms = float("nan")
        self.last_stage_ms: dict[str, float] = {}

    # ------------------------------------------------------------------------------------ public
    @property
    def cpu(self) -> Engine:
        if self._cpu is None:
            from toktier_backend.engines.hf import HFEngine

            self._cpu = HFEngine(self.path)
        return self._cpu

    def reserve(self, n: int) -> None:
        """Nothing to load: calls are serialized (one device pass at a time)."""

    def accepts(self, text: str) -> bool:
        """Whether :meth:`encode` runs ``text`` on the device (else it takes the CPU engine)."""
        if not self.tables.accepts(text):
            return False
        return len(text) * 4 <= self.max_bytes or len(text.encode("utf-8")) <= self.max_bytes

    def encode(self, text: str) -> np.ndarray:
        """Body ids of ``text``: ``int32[n]``, equal to HF ``encode(text, add_special_tokens=False).ids``."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Body ids of each text; the accepted ones share one device pass (each text is its own segment)."""
        out: list[np.ndarray | None] = [None] * len(texts)
        datas, where = [], []
        for k, text in enumerate(texts):
            if not text:
                out[k] = np.zeros(0, dtype=np.int32)
            elif not self.tables.accepts(text):
                self.stats["cpu_not_accepted"] += 1
                out[k] = self.cpu.encode(text)
            else:
                data = text.encode("utf-8")
                if len(data) > self.max_bytes:
                    self.stats["cpu_too_large"] += 1
                    out[k] = self.cpu.encode(text)
                else:
                    datas.append(data)
                    where.append(k)
        # pack into device passes of at most max_bytes
        i = 0
        while i < len(datas):
            j, tot = i, 0
            while j < len(datas) and tot + len(datas[j]) <= self.max_bytes:
                tot += len(datas[j])
                j += 1
            for k, ids in zip(where[i:j], self._run(datas[i:j])):
                out[k] = ids
            i = j
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------------------------- internals
    def _size_class(self, nbytes: int, nspans: int) -> _SizeClass:
        cap = MIN_CLASS
        while cap < nbytes:
            cap *= 4
        spans_needed = cap // max(1, self._min_added) + 1
        sc = self._classes.get(cap)
        if sc is None or sc.max_spans < nspans:
            sc = _SizeClass(cap, max(spans_needed, nspans, 64))
            self._classes[cap] = sc
        return sc

    def _run(self, datas: list[bytes]) -> list[np.ndarray]:
        with self._lock:
            spans: list[tuple[int, int, int]] = []
            starts: list[int] = []
            off = 0
            for data in datas:
                starts.append(off)
                if off:
                    spans.append((off, off, K.SPAN_BREAK))
                spans.extend((a + off, b + off, i) for a, b, i in self.tables.added.spans(data))
                off += len(data)
            n = off
            sc = self._size_class(n, max(len(spans), len(starts)))
            self._last = sc
            if self.use_graphs:
                self._ensure_cupy_stream()
            s = self._stream
            sc.h_bts[:n] = np.frombuffer(b"".join(datas), dtype=np.uint8)
            sc.h_counts[:] = 0
            sc.h_counts[K.C_NBYTES] = n
            sc.h_counts[K.C_NADDED] = len(spans)
            if spans:
                sc.h_added[: len(spans)] = np.asarray(spans, dtype=np.int32)
            sc.h_bstarts[: len(starts)] = starts
            sc.bts[:n].copy_to_device(sc.h_bts[:n], stream=s)
            sc.counts.copy_to_device(sc.h_counts, stream=s)
            if spans:
                sc.added[: len(spans)].copy_to_device(sc.h_added[: len(spans)], stream=s)
            if self.time_device:
                ev0 = cuda.event()
                ev0.record(s)
            self._launch_or_replay(sc)
            if self.time_device:
                ev1 = cuda.event()
                ev1.record(s)
            nb = len(starts)
            if nb > 1:
                sc.bstarts[:nb].copy_to_device(sc.h_bstarts[:nb], stream=s)
                K.k_batch_offsets[1, 32, s](sc.counts, sc.bstarts, nb, sc.lead, sc.ptidx, sc.ntok, sc.tokoff, sc.boffs)
            sc.counts.copy_to_host(sc.h_counts, stream=s)
            s.synchronize()
            if self.time_device:
                self.last_device_ms = ev0.elapsed_time(ev1)
                if self._stage_events:
                    evs = self._stage_events
                    self.last_stage_ms = {name: a.elapsed_time(b)
                                          for (_, a), (name, b) in zip(evs, evs[1:])}
            ntot = int(sc.h_counts[K.C_NTOK])
            sc.out[:ntot].copy_to_host(sc.h_out[:ntot], stream=s)
            if nb > 1:
                sc.boffs[:nb].copy_to_host(sc.h_boffs[:nb], stream=s)
            s.synchronize()
            self.stats["gpu"] += nb
            ids = np.array(sc.h_out[:ntot], dtype=np.int32)
            if nb == 1:
                return [ids]
            bounds = list(sc.h_boffs[:nb]) + [ntot]
            return [ids[bounds[k] : bounds[k + 1]] for k in range(nb)]

    def _launch_or_replay(self, sc: _SizeClass) -> None:
        if self.use_graphs and getattr(self, "_cupy_stream", None) is not None:
            try:
                if sc.graph is None:
                    sc.graph = self._capture(sc)
                sc.graph.launch(self._cupy_stream)
                self.stats["graph_launches"] += 1
                return
            except Exception as e:  # capture unsupported by this toolchain: direct launches from now on
                log.warning("CUDA graph capture failed (%s: %s); launching kernels directly", type(e).__name__, e)
                self.use_graphs = False
        self._launch(sc, self._stream)

    def _ensure_cupy_stream(self) -> None:
        """Graphs are captured and replayed on a CuPy stream; numba launches and copies go to the same
        stream through ``cuda.external_stream`` (from then on, for both launch modes)."""
        if getattr(self, "_cupy_stream", None) is None:
            try:
                self._cupy_stream = _cupy().cuda.Stream(non_blocking=True)
                self._stream = cuda.external_stream(self._cupy_stream.ptr)
            except Exception as e:
                log.warning("no CuPy stream for CUDA graphs (%s: %s); launching kernels directly", type(e).__name__, e)
                self._cupy_stream = None
                self.use_graphs = False

    def _capture(self, sc: _SizeClass):
        self._launch(sc, self._stream)  # warm-up: compile and load every kernel outside the capture
        self._stream.synchronize()
        self._cupy_stream.begin_capture()
        try:
            self._launch(sc, self._stream)
        finally:
            graph = self._cupy_stream.end_capture()
        return graph

    def _scan(self, sc: _SizeClass, a, out, nch: int, nidx: int, op: int, s) -> None:
        if nch == 0:
            return
        g, b = sc.scan_grid
        K.k_scan1[g, b, s](a, nch, sc.counts, nidx, op, sc.agg)
        K.k_scan2[1, W_.SCAN2_BLOCK, s](nch, g * b, op, sc.agg)
        K.k_scan3[g, b, s](a, out, nch, sc.counts, nidx, op, sc.agg)

    def _mark(self, name: str, s) -> None:
        if self._stage_events is not None:
            ev = cuda.event()
            ev.record(s)
            self._stage_events.append((name, ev))

    def _launch(self, sc: _SizeClass, s) -> None:
        """The fixed launch sequence (no host sync; every count lives in ``sc.counts``)."""
        self._stage_events = [] if (self.time_device and not self.use_graphs) else None
        self._mark("start", s)
        t = self.tables
        eg, eb = sc.ew
        fam = t.family_code
        K.k_reset[1, 32, s](sc.counts)
        K.k_decode[eg, eb, s](sc.bts, sc.counts, sc.lead, self._byte_ids, sc.sym)
        self._scan(sc, sc.lead, sc.lead, 1, K.C_NBYTES, K.OP_SUM, s)
        K.k_scatter[eg, eb, s](sc.bts, sc.counts, sc.lead, sc.cps, sc.cpbyte, sc.cls, sc.seg, sc.addid,
                               self._ctab, self._ftab)
        K.k_added[eg, eb, s](sc.counts, sc.added, sc.lead, sc.seg, sc.addid)
        self._mark("decode", s)
        K.k_markers[eg, eb, s](sc.counts, sc.cls, sc.seg, sc.fwd, sc.rev, fam)
        self._scan(sc, sc.fwd, sc.fwd, self._nfwd, K.C_NCP, K.OP_MAX, s)
        self._scan(sc, sc.rev, sc.rev, 1 if fam == 0 else 2, K.C_NCP, K.OP_MINREV, s)
        K.k_starts[eg, eb, s](sc.counts, sc.cps, sc.cls, sc.seg, sc.addid, sc.fwd, sc.rev, fam, sc.start)
        self._scan(sc, sc.start, sc.ptidx, 1, K.C_NCP, K.OP_SUM, s)
        K.k_pretokens[eg, eb, s](sc.counts, sc.ptidx, sc.cpbyte, sc.addid, sc.pt_b0, sc.pt_aid)
        self._mark("pretokenize", s)
        vk, vi, blob, boff, items = self._vh
        K.k_classify[eg, eb, s](sc.counts, sc.bts, sc.sym, sc.pt_b0, sc.pt_aid, sc.ntok, sc.shortlist, sc.longlist,
                                1 if t.ignore_merges else 0, t.max_token_bytes, vk, vi, blob, boff, items, WARP_MAX)
        mk_a, mk_b, m_rank, m_new = self._mk
        self._mark("classify", s)
        wg, wb = sc.warp_grid
        k_bpe_warp[wg, wb, s](sc.counts, sc.sym, sc.pt_b0, sc.shortlist, sc.ntok, mk_a, mk_b, m_rank, m_new)
        self._mark("bpe_warp", s)
        bg, bb = sc.block_grid
        k_bpe_block[bg, bb, s](sc.counts, sc.sym, sc.tmp, sc.rk, sc.nw, sc.sel, sc.pt_b0, sc.longlist, sc.ntok,
                               mk_a, mk_b, m_rank, m_new)
        self._mark("bpe_block", s)
        self._scan(sc, sc.ntok, sc.tokoff, 1, K.C_NPT, K.OP_SUM, s)
        K.k_gather[eg, eb, s](sc.counts, sc.sym, sc.pt_b0, sc.ntok, sc.tokoff, sc.out)
        self._mark("gather", s)


def _cupy():
    try:
        import cupy

        return cupy
    except Exception:  # not installed, or no driver
        return None
