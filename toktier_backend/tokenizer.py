"""Public API: :func:`load_tokenizer`, :class:`Tokenizer`, :class:`Session`.

A request's path, top-down::

    Session.update(text) / .append(delta)
      -> validate (UTF-8 scalar values, size)                              tokenizer._validate
      -> departure point d (append: old length; update: common prefix)     pipeline.repair.departure
      -> last stable cut c <= d - 1 on a token boundary, widening the window  pipeline.repair.find_cut
      -> re-encode text[c:] with the admitted engine (reference if guarded)  engines / engines.admission
      -> splice ids and offsets (copy-on-write), return a read-only view    pipeline.token_buffer

Example (GPT-2, ids from the HF reference)::

    >>> import toktier_backend as tt
    >>> tok = tt.load_tokenizer(tt.default_tokenizer_path())
    >>> tok.encode("hello world").tolist()
    [31373, 995]
    >>> s = tok.session()
    >>> s.update("hello").tolist(); s.append(" world").tolist()
    [31373]
    [31373, 995]
"""

from __future__ import annotations

import logging
import os
import weakref
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from toktier_backend.config import DEFAULT_SPECS
from toktier_backend.engines.admission import Admission, admit, check_offsets, reference_only
from toktier_backend.engines.hf import HFEngine
from toktier_backend.engines.protocol import Engine
from toktier_backend.engines.registry import FAST_ENGINE_ORDER, create
from toktier_backend.errors import EngineUnavailable, InvalidRequest, ToktierError, UnsupportedTokenizer
from toktier_backend.pipeline.chunked import ChunkedEncoder
from toktier_backend.pipeline.cuts import CutFinder
from toktier_backend.pipeline.prefix_index import PrefixIndex
from toktier_backend.pipeline.repair import WIDENINGS, WINDOW, RepairInfo, departure, repair  # noqa: F401
from toktier_backend.pipeline.repair import common_prefix_len as _common_prefix_len
from toktier_backend.pipeline.text_store import TextStore
from toktier_backend.pipeline.token_buffer import TokenBuffer
from toktier_backend.spec import TokenizerSpec, load_spec, resolve_path

log = logging.getLogger(__name__)

#: Default request size limit (chars); a serving config can lower it.
MAX_CHARS = 64 * 1024 * 1024
#: Routes served by the fast path; each can be quarantined per tokenizer (see ``Tokenizer.quarantine``).
FAST_ROUTES = ("full", "append", "edit")


def default_tokenizer_path() -> Path:
    """The bundled GPT-2 ``tokenizer.json`` (MIT, openai-community/gpt2)."""
    return Path(str(resources.files("toktier_backend") / "data" / "gpt2" / "tokenizer.json"))


def tokenizer_path(spec: str | os.PathLike | None = None) -> Path:
    """The local ``tokenizer.json`` a spec names: ``None`` or one of :data:`toktier_backend.config.DEFAULT_SPECS`, the bundled GPT-2
    file; else a file, a folder holding one, or a Hugging Face Hub id (:func:`toktier_backend.spec.resolve_path`).

    Raises:
        UnsupportedTokenizer: nothing found locally and the Hub download failed.
    """
    return default_tokenizer_path() if spec is None or spec in DEFAULT_SPECS else resolve_path(spec)


def decode_text(data: bytes, *, what: str = "TEXT") -> str:
    """Strict UTF-8 decode of a request field.

    Raises:
        InvalidRequest: ``data`` is not valid UTF-8 (names the byte offset).
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(
            f"{what} is not valid UTF-8: byte {e.object[e.start:e.start + 1]!r} at offset {e.start} ({e.reason}); "
            "send UTF-8 text"
        ) from None


def _validate(text: str, max_chars: int, what: str = "text", *, scalars: bool = True) -> None:
    if not isinstance(text, str):
        raise InvalidRequest(f"{what} must be str, got {type(text).__name__}")
    if len(text) > max_chars:
        raise InvalidRequest(f"{what} has {len(text)} chars, over the limit of {max_chars}; split the request")
    if scalars:
        _check_scalars(text, 0, what)


def _check_scalars(text: str, start: int = 0, what: str = "text") -> None:
    """Raise ``InvalidRequest`` if ``text[start:]`` holds a lone surrogate (the error names its char index in
    ``text``). Free for ASCII; otherwise one UTF-32 encode (cheaper than UTF-8: ``docs/design/pipeline.md``)."""
    part = text[start:] if start else text
    if part.isascii():
        return
    try:
        part.encode("utf-32-le")
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{what} holds a lone surrogate {part[e.start]!r} at char {start + e.start}: not a Unicode scalar value; "
            "send valid UTF-8 text"
        ) from None


class Tokenizer:
    """An exact tokenizer with repairing sessions.

    Args:
        spec: the loaded file (see :func:`load_tokenizer`).
        engine: fast engine name, ``"auto"`` (first admitted of ``FAST_ENGINE_ORDER``) or ``"hf"``.
        max_chars: request size limit (chars).

    Every id it returns equals HF ``Tokenizer.from_file(path).encode(text, add_special_tokens=...).ids``.

    Attributes:
        engine: the admitted :class:`~toktier_backend.engines.protocol.Engine` (the HF reference when none
            was admitted); assigning another one (after admission) makes every path use it.
        admission: its :class:`~toktier_backend.engines.admission.Admission` (guard set); assignable too.
        chunked: the :class:`~toktier_backend.pipeline.chunked.ChunkedEncoder` of whole texts.
    """

    def __init__(self, spec: TokenizerSpec, *, engine: str = "auto", max_chars: int = MAX_CHARS):
        self.spec = spec
        self.reference = spec.reference
        self.max_chars = max_chars
        self._hf = HFEngine(str(spec.path), spec.reference)
        check_offsets(spec)
        self.cuts = CutFinder(spec)
        eng, adm = self._choose_engine(engine)
        #: Whole texts: one engine call, or for long ones chunks at stable cuts on the shared pool
        #: (``pipeline/chunked.py``).
        self.chunked = ChunkedEncoder(eng, reference=self._hf, guard=adm, cuts=self.cuts)
        self._engine, self._admission = eng, adm
        #: shared prefixes of fresh requests, reused by content (``None`` when no cut can be proven)
        self.prefix_index = (
            PrefixIndex(self.cuts, spec.token_nbytes, spec.normalized_nbytes)
            if self.cuts.supported and spec.token_nbytes is not None else None
        )
        if self.prefix_index is not None:  # its background inserts wait while a chunked encode runs
            self.prefix_index.yield_to = self._chunks_idle_waiter(self.chunked)
        #: Quarantined fast routes (``FAST_ROUTES`` names -> reason): requests that would take one are served
        #: by the reference on the whole text. Set by the shadow verifier, cleared by an operator.
        self.quarantined: dict[str, str] = {}
        #: Bumped by every new quarantine: sessions built before it rebuild once from the reference.
        self.quarantine_epoch = 0
        self._repair_encoders = _RepairEncoders(self)  # what every session's repair calls

    @property
    def engine(self) -> Engine:
        return self._engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self._engine = self.chunked.engine = engine

    @property
    def admission(self) -> Admission:
        return self._admission

    @admission.setter
    def admission(self, admission: Admission) -> None:
        self._admission = self.chunked.guard = admission

    @staticmethod
    def _chunks_idle_waiter(chunked: ChunkedEncoder) -> Callable[[float], bool]:
        """``(timeout_s) -> bool``: wait until ``chunked``'s current pool runs no chunk task. Holds ``chunked``
        weakly: the indexer's thread lives as long as the process, the tokenizer need not."""
        ref = weakref.ref(chunked)

        def wait(timeout: float) -> bool:
            ch = ref()
            return True if ch is None else ch.pool.wait_chunks_idle(timeout)

        return wait

    # ------------------------------------------------------------------ construction
    def _choose_engine(self, wanted: str) -> tuple[Engine, Admission]:
        if wanted == "hf":
            return self._hf, reference_only("engine 'hf' requested")
        names = FAST_ENGINE_ORDER if wanted == "auto" else (wanted,)
        reasons = []
        for name in names:
            try:
                eng = create(name, str(self.spec.path))
            except EngineUnavailable as e:
                reasons.append(str(e))
                continue
            adm = admit(self.spec, eng)
            if adm.admitted:
                return eng, adm
            reasons.append(f"{name}: {adm.reason}")
        if wanted != "auto":
            raise EngineUnavailable(f"engine {wanted!r} not admitted for {self.spec.path}: {'; '.join(reasons)}")
        log.warning("no fast engine admitted for %s, using the reference: %s", self.spec.path, reasons)
        return self._hf, reference_only("; ".join(reasons))

    @property
    def path(self) -> Path:
        return self.spec.path

    @property
    def family(self) -> str:
        """Cut family derived from the file's structure (``"gpt2"``, ``"cl100k"``, ``"o200k"``,
        ``"deepseek_v3"``, ``"segments"``, or ``"none"``)."""
        return self.cuts.name

    def describe(self) -> dict:
        """Facts about this tokenizer for logs and ``toktier`` output."""
        return {
            "path": str(self.spec.path), "sha256": self.spec.sha256, "family": self.family,
            "family_reason": self.cuts.reason, "engine": self.engine.name,
            "engine_admitted": self.admission.admitted, "guarded_code_points": len(self.admission.guarded),
            "prefix_ids": None if self.spec.prefix_ids is None else self.spec.prefix_ids.tolist(),
            "suffix_ids": None if self.spec.suffix_ids is None else self.spec.suffix_ids.tolist(),
            "notes": self.spec.notes,
        }

    # ------------------------------------------------------------------ quarantine
    def quarantine(self, route: str, reason: str) -> bool:
        """Stop serving ``route`` (one of :data:`FAST_ROUTES`) from the fast path: the reference serves
        the whole text instead, and every live session rebuilds once from the reference on its next call.

        Returns:
            True if ``route`` was not quarantined before.

        Raises:
            ValueError: ``route`` is not a fast route.
        """
        if route not in FAST_ROUTES:
            raise ValueError(f"route {route!r} cannot be quarantined; fast routes: {list(FAST_ROUTES)}")
        new = route not in self.quarantined
        self.quarantined[route] = reason
        if new:
            self.quarantine_epoch += 1
            if self.prefix_index is not None:  # indexed ids may come from the quarantined route
                self.prefix_index.clear()
            log.error("route %r quarantined for %s (sha256 %s): %s", route, self.spec.path, self.spec.sha256[:16], reason)
        return new

    def release(self, route: str | None = None) -> list[str]:
        """Clear the quarantine of ``route`` (``None``: all). Returns the routes released."""
        routes = list(self.quarantined) if route is None else [r for r in (route,) if r in self.quarantined]
        for r in routes:
            del self.quarantined[r]
            log.warning("route %r released from quarantine for %s", r, self.spec.path)
        if routes and self.prefix_index is not None:  # inserts queued before the quarantine may have landed
            self.prefix_index.clear()
        return routes

    def _fallback_reason(self, text: str, route: str) -> str:
        """Why ``encode_body(text, route=route)`` answered with the reference (only asked when it did)."""
        if self.engine is self._hf:
            return ""
        if route in self.quarantined:
            return "quarantined"
        return "guarded" if self.admission.has_guarded(text) else "engine_error"

    # ------------------------------------------------------------------ encoding
    def needs_reference(self, add_special_tokens: bool) -> bool:
        """Requests the fast path cannot serve exactly: non-constant post-processor or truncation/padding."""
        return self.spec.has_truncation_or_padding or (add_special_tokens and self.spec.prefix_ids is None)

    def encode_body(self, text: str, *, route: str = "full") -> tuple[np.ndarray, str]:
        """Body ids (no post-processor) and the engine that produced them.

        The admitted engine serves texts without guarded code points on routes that are not quarantined
        (a long text in chunks, each checked on its own: :class:`ChunkedEncoder`); everything else, and any
        engine error, goes to the reference.
        """
        quarantined = route in self.quarantined
        if not quarantined and self.chunked.wants(text):  # guard set checked per chunk
            return self.chunked.encode(text)
        eng = self._engine
        if eng is not self._hf and not quarantined and not self._admission.has_guarded(text):
            try:
                return eng.encode(text), eng.name
            except Exception as e:  # never answer approximately: the reference takes it
                log.warning("engine %s failed (%s); reference used", eng.name, e)
        return self._hf.encode(text), "hf"

    def encode_fresh(self, text: str) -> tuple[np.ndarray, str]:
        """Body ids of a whole text that has no session state (first turn, rebuild, stateless call).

        The deepest indexed prefix of ``text`` (confirmed char by char) is reused and only the rest is
        encoded; then the text's own chunks are indexed for later requests by a background thread.
        Texts shorter than two index steps skip the index.

        Only the part of ``text`` that is encoded here is checked for lone surrogates: a reused prefix equals
        an indexed text char for char, and that text was checked when it was encoded (what this saves:
        ``docs/design/prefix_index.md``).

        Raises:
            InvalidRequest: the encoded part holds a lone surrogate (names its char index in ``text``).
        """
        idx = self.prefix_index
        indexed = idx is not None and not self.quarantined and len(text) >= 2 * idx.step  # no reuse in quarantine
        hit = idx.lookup(text) if indexed else None
        start = 0 if hit is None else hit.cut  # a stable cut of text
        if "full" not in self.quarantined and self.chunked.available:
            # one UTF-8 conversion per chunk: surrogate check, guard check and engine input (chunks of a long
            # text on the pool, each checked on its own)
            body, engine = self.chunked.encode(text, start)
        else:  # the reference, or an engine that holds the GIL, on the whole rest
            _check_scalars(text, start)
            body, engine = self.encode_body(text[start:] if start else text)
        if hit is not None:
            body = np.concatenate([*hit.parts, body])  # one copy of the ids
            engine += "+prefix"
        if indexed:
            idx.insert_later(text, body, after=hit)  # hashed off the request path
        return body, engine

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """Ids of ``text``.

        Args:
            text: the text (Unicode scalar values only).
            add_special_tokens: apply the post-processor (e.g. Llama 3's ``<|begin_of_text|>``).

        Returns:
            ``np.ndarray[int32] (n_tokens,)``, equal to HF ``encode(text, add_special_tokens=...).ids``.

        Raises:
            InvalidRequest: lone surrogates, not ``str``, or over ``max_chars``.
        """
        return self.encode_with_body(text, add_special_tokens, self.encode_fresh)[0]

    def encode_with_body(self, text: str, add_special_tokens: bool,
                         body_fn: Callable[[str], tuple[np.ndarray, str]]) -> tuple[np.ndarray, str]:
        """:meth:`encode` with the body of the text from ``body_fn(text) -> (int32[n] body ids, label)``
        (:meth:`encode_fresh`; a GPU model instance passes its router, ``faces/triton.py``). Validation
        and the post-processor are the same whatever ``body_fn`` is.

        Returns:
            the ids (as :meth:`encode`) and ``body_fn``'s label, or ``"reference"`` when the whole text went to
            the HF reference (non-constant post-processor, truncation or padding: ``body_fn`` is not called).

        Raises:
            InvalidRequest: as :meth:`encode`.
        """
        _validate(text, self.max_chars, scalars=False)
        reference_only = self.needs_reference(add_special_tokens)
        if reference_only or body_fn != self.encode_fresh:
            # (encode_fresh checks only what it encodes: a chunked text chunk by chunk on the pool, where a
            # whole-text check would hold the GIL that a session repair on another thread waits for
            # (docs/design/pipeline.md); a prefix hit only its tail)
            _check_scalars(text)
        if reference_only:
            ids = self.reference.encode(text, add_special_tokens=add_special_tokens).ids
            return np.asarray(ids, dtype=np.int32), "reference"
        try:
            body, label = body_fn(text)
        except (UnicodeEncodeError, TypeError):  # HF raises TypeError on a lone surrogate
            _validate(text, self.max_chars)  # one the chunks did not see (a prefix-index tail, a quarantine)
            raise
        if not add_special_tokens or (len(self.spec.prefix_ids) == 0 and len(self.spec.suffix_ids) == 0):
            return body, label
        return np.concatenate([self.spec.prefix_ids, body, self.spec.suffix_ids]), label

    def session(self, *, add_special_tokens: bool = True) -> "Session":
        """A new, empty session (see :class:`Session`)."""
        return Session(self, add_special_tokens=add_special_tokens)


class Session:
    """Stateful tokenization of one growing or edited text.

    Holds the text (blocks, no O(n) copy per append), the ids and the token end offsets. Not thread-safe:
    the serving layer runs one request per session at a time (Triton's sequence batcher does). The repair
    itself is :func:`toktier_backend.pipeline.repair.repair`; this class validates and keeps the state.

    Invariant after every call: ``ids == HF encode(text, add_special_tokens=flag).ids``. Every array a
    call returns keeps its values after later calls (the buffer copies on write, ``pipeline/token_buffer.py``).
    """

    def __init__(self, tokenizer: Tokenizer, *, add_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        spec = tokenizer.spec
        self._reference_only = tokenizer.needs_reference(add_special_tokens)
        empty = np.zeros(0, dtype=np.int32)
        pre = spec.prefix_ids if add_special_tokens and not self._reference_only else empty
        suf = spec.suffix_ids if add_special_tokens and not self._reference_only else empty
        self._store = TextStore()
        self._buf = TokenBuffer(pre, suf)
        self._ref_ids: np.ndarray | None = None  # whole reply, for reference-only sessions
        self.last_repair = RepairInfo()
        self.requests = 0
        self._epoch = tokenizer.quarantine_epoch  # ids built under this quarantine state
        self._enc = tokenizer._repair_encoders
        if self._reference_only:
            self._ref_ids = _read_only(tokenizer.encode("", add_special_tokens=add_special_tokens))
        else:
            self._buf.splice(0, empty, spec.token_nbytes if spec.token_nbytes is not None else np.zeros(1, np.int32))

    # ------------------------------------------------------------------ state
    @property
    def text(self) -> str:
        """The session's whole text (joins blocks on first access after appends: O(n))."""
        return self._store.text

    def text_blocks(self) -> tuple[str, ...]:
        """The text as an immutable snapshot of blocks, O(blocks) (``"".join`` gives :attr:`text` as of this
        call; ``pipeline/text_store.py``): for a reader off the request path, which joins it there."""
        return self._store.blocks()

    def tail(self, start: int) -> str:
        """``self.text[start:]`` without joining the text before ``start``: O(len(self) - start) chars."""
        return self._store.tail(start)

    def __len__(self) -> int:
        """Length of the text (chars)."""
        return len(self._store)

    @property
    def ids(self) -> np.ndarray:
        """``np.ndarray[int32] (n,)``, read-only: the ids of :attr:`text`. Later calls never change it."""
        if self._ref_ids is not None:
            return self._ref_ids
        return self._buf.ids()

    @property
    def nbytes(self) -> int:
        """Memory held: text blocks + id/offset buffers (bytes)."""
        ref = self._ref_ids.nbytes if self._ref_ids is not None else 0
        return self._store.nbytes + self._buf.nbytes + ref

    # ------------------------------------------------------------------ requests
    def update(self, text: str) -> np.ndarray:
        """Full-text mode: ``text`` is the whole new text (an append, an edit, or a truncation).

        Returns:
            ``np.ndarray[int32] (n,)``, read-only: HF ``encode(text, add_special_tokens=flag).ids``. Later
            calls on the session never change it (holding it costs one copy of the ids only when a later
            call rewrites ids it shows: an edit or truncation, see ``pipeline/token_buffer.py``).

        Raises:
            InvalidRequest: bad text; the session is unchanged.
        """
        _validate(text, self.tokenizer.max_chars)
        return self._serve(text, whole=True)

    def append(self, delta: str) -> np.ndarray:
        """Delta mode: the new text is ``self.text + delta``.

        Returns / Raises: as :meth:`update`.
        """
        tok = self.tokenizer
        _validate(delta, tok.max_chars, "delta")
        old_len = self._store.length
        if old_len + len(delta) > tok.max_chars:
            raise InvalidRequest(f"session text would reach {old_len + len(delta)} chars, over the limit of {tok.max_chars}")
        return self._serve(delta, whole=False)

    def splice(self, departure: int, delta: str) -> np.ndarray:
        """Splice mode: the new text is ``self.text[:departure] + delta`` (an edit or truncation whose
        departure the caller knows, such as :class:`toktier_backend.chat.session.ChatRender`'s). Neither the
        old text before ``departure`` nor the new text is joined or compared: the repair starts from
        ``departure`` (a lower bound of the true departure point is enough: the text before it is kept).

        Args:
            departure: chars of the stored text kept, ``0 <= departure <= len(self)``.
            delta: the new text after them.

        Returns / Raises: as :meth:`update`; also ``InvalidRequest`` when ``departure`` is out of range.
        """
        tok = self.tokenizer
        old_len = self._store.length
        if type(departure) is not int or not 0 <= departure <= old_len:
            raise InvalidRequest(f"splice departure {departure!r} is outside the session text (0..{old_len} chars)")
        _validate(delta, tok.max_chars, "delta")
        if departure + len(delta) > tok.max_chars:
            raise InvalidRequest(
                f"session text would reach {departure + len(delta)} chars, over the limit of {tok.max_chars}")
        return self._serve(delta, whole=False, at=departure)

    # ------------------------------------------------------------------ the repair
    @property
    def _stale(self) -> bool:
        """A route was quarantined since these ids were built: they may hold its wrong output."""
        return self._ref_ids is None and self._epoch != self.tokenizer.quarantine_epoch

    def _serve(self, new: str, *, whole: bool, at: int | None = None) -> np.ndarray:
        """``new``: the whole new text (``whole``), or a delta put after the stored text's first ``at``
        chars (``None``: all of them). Departure point, then the repair."""
        tok = self.tokenizer
        store = self._store
        d = departure(store, new, whole=whole) if at is None else at
        first = self.requests == 0
        unchanged = d == store.length == (len(new) if whole else d + len(new))
        self.requests += 1
        stale = self._stale
        if unchanged and not first and not stale:
            ids = self.ids
            self.last_repair = RepairInfo(route="noop", departure=d, cut=d, reused=len(ids), engine="none")
            return ids
        if self._ref_ids is not None:  # reference-only session: whole text through HF, every time
            text = new if whole else (store.text if at is None else store.text[:at]) + new
            ids = tok.reference.encode(text, add_special_tokens=self.add_special_tokens).ids
            ids = _read_only(np.asarray(ids, dtype=np.int32))
            reused = _common_prefix_len(self._ref_ids, ids)
            store.replace(text)
            self._ref_ids = ids
            self.last_repair = RepairInfo(route="reference", departure=d, reused=reused, reencoded=len(ids))
            return ids
        info = repair(self._enc, store, self._buf, new, whole=whole, d=d, force_reference=stale,
                      quarantined=tok.quarantined, first=first, splice=at is not None)
        if info.route == "full":  # whole text re-encoded under the current quarantine state
            self._epoch = tok.quarantine_epoch
        self.last_repair = info
        return self._buf.ids()


class _RepairEncoders:
    """A tokenizer as :class:`toktier_backend.pipeline.repair.Encoders`: its cut finder, offsets table and
    bound methods as plain attributes, one object per tokenizer (each is fixed once the tokenizer is built:
    ``check_offsets`` runs in ``Tokenizer.__init__``; a later engine assignment is read by ``encode_body``)."""

    __slots__ = ("cuts", "token_nbytes", "normalized_nbytes", "encode_body", "encode_fresh", "encode_reference",
                 "fallback_reason")

    def __init__(self, tok: Tokenizer):
        self.cuts: CutFinder = tok.cuts
        self.token_nbytes: np.ndarray | None = tok.spec.token_nbytes
        self.normalized_nbytes: Callable[[str], int] = tok.spec.normalized_nbytes
        self.encode_body: Callable[..., tuple[np.ndarray, str]] = tok.encode_body
        self.encode_fresh: Callable[[str], tuple[np.ndarray, str]] = tok.encode_fresh
        self.encode_reference: Callable[[str], np.ndarray] = tok._hf.encode
        self.fallback_reason: Callable[[str, str], str] = tok._fallback_reason


def _read_only(ids: np.ndarray) -> np.ndarray:
    """``ids`` itself, made read-only (a reply of a reference-only session)."""
    ids.flags.writeable = False
    return ids


def load_tokenizer(
    spec: str | os.PathLike | None = None, *, engine: str = "auto", max_chars: int = MAX_CHARS,
    sha256: str | None = None,
) -> Tokenizer:
    """Load a tokenizer.

    Only JSON is read (no pickle, no remote code): the file is parsed by ``json`` and HF ``tokenizers``.

    Args:
        spec: path to a ``tokenizer.json``, a folder holding one, or a Hugging Face Hub id (needs a
            network); ``None``, ``""`` or ``"default"`` loads the bundled GPT-2 file (:func:`tokenizer_path`).
        engine: ``"auto"``, ``"gigatoken"``, ``"fastokens"`` or ``"hf"``.
        max_chars: request size limit (chars).
        sha256: hex digest the file's bytes must have (a pin); ``None`` accepts any file.

    Raises:
        UnsupportedTokenizer: file missing, malformed, refused by HF ``tokenizers``, or its sha256 is not
            the pinned one.
        EngineUnavailable: a named engine is missing or not admitted for this file.
    """
    path = tokenizer_path(spec)
    if sha256:
        _check_sha256(path, Path(path).read_bytes(), sha256)
    loaded = load_spec(path)
    if sha256:
        _check_sha256(path, None, sha256, got=loaded.sha256)  # the bytes parsed are the bytes checked
    return Tokenizer(loaded, engine=engine, max_chars=max_chars)


def _check_sha256(path, raw: bytes | None, want: str, *, got: str | None = None) -> None:
    import hashlib

    want = want.strip().lower()
    got = got if got is not None else hashlib.sha256(raw).hexdigest()
    if got != want:
        raise UnsupportedTokenizer(
            f"{path}: sha256 {got} is not the pinned {want!r}; the file changed or is not the one configured. "
            "Serve the pinned file, or update the pin (model parameter tokenizer_sha256 / --tokenizer-sha256)."
        )


__all__ = ["RepairInfo", "Session", "Tokenizer", "ToktierError", "Admission", "decode_text",
           "default_tokenizer_path", "load_tokenizer"]
