"""Anchors: the tokenizers we measure ourselves against, each behind one uniform callable.

Every anchor loads a local ``tokenizer.json`` and runs offline (see ``/work/shared/ANCHORS.md``):

- ``hf``: Hugging Face ``tokenizers``, the reference for exactness;
- ``gigatoken``: ``gigatoken.Tokenizer(path).encode(text)`` (warmed twice at load);
- ``fastokens``: ``fastokens.Tokenizer.from_file(path)``, ids read through ``encode_batch_flat`` (no per-token
  Python objects), segment cache off;
- ``toktier`` 0.3.0: a *session* (:class:`ToktierSession`), staged from a local manifest so that
  ``toktier.load(family, device="cpu", manifest=...)`` works without the Hub;
- ``ours``: ``toktier_backend.load_tokenizer(path).encode``.

A full-encode anchor is an :class:`Anchor` whose ``encode(text) -> ndarray`` returns the core token stream
(no post-processor), which equals HF ``Tokenizer.encode(text, add_special_tokens=False).ids``. An anchor
that cannot run here has ``encode is None`` and a ``reason``; callers print the reason and leave the
column empty. Never time an anchor before :func:`check_exact` has compared it with HF on a sample.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

#: Our tokenizer name (folder under ``shared/tokenizers``) -> toktier 0.3.0 family id.
#: ``llama3_1`` is the Instruct file: toktier 0.3.0 has no certified fast path for it and runs HF
#: (a full re-encode per append); it is measured anyway and labelled by its route.
TOKTIER_FAMILIES = {"qwen3": "qwen3_8b", "deepseek_v3": "deepseek_v3", "llama3_1": "llama_3_1_8b"}

Encode = Callable[[str], np.ndarray]


def ensure_repo_on_path() -> None:
    """Make ``import toktier_backend`` find this checkout when a script runs from ``bench/``."""
    if str(REPO) not in sys.path:
        sys.path.insert(1, str(REPO))


def shared_dir(path: str | Path | None = None) -> Path:
    """The shared folder: ``path`` when given, else ``<repo>/../shared``.

    Raises:
        FileNotFoundError: it has no ``tokenizers`` folder.
    """
    shared = Path(path) if path is not None else REPO.parent / "shared"
    if not (shared / "tokenizers").is_dir():
        raise FileNotFoundError(f"{shared}: no 'tokenizers' folder; pass --shared <folder>")
    return shared


def tokenizer_path(name: str, shared: Path) -> Path:
    """``shared/tokenizers/<name>/tokenizer.json``, checked to exist."""
    path = shared / "tokenizers" / name / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tokenizer file (names: "
                                f"{sorted(p.name for p in (shared / 'tokenizers').iterdir() if p.is_dir())})")
    return path


@dataclass
class Anchor:
    """One system behind a uniform full-encode callable.

    ``encode(text)`` returns the ids as a 1-D integer ndarray (dtype as the library hands it over:
    int32 or uint32), or ``encode is None`` and ``reason`` says why it cannot run here.
    """

    name: str
    encode: Encode | None
    reason: str = ""
    version: str = ""


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "?"


def core_revision() -> dict:
    """The checkout the numbers came from: HEAD and whether ``toktier_backend/`` differs from it."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    return {"head": git("rev-parse", "--short", "HEAD"),
            "core_dirty": bool(git("status", "--porcelain", "--", "toktier_backend"))}


# -- full-encode anchors ------------------------------------------------------------------------

def hf(path: Path, *, add_special_tokens: bool = False) -> Anchor:
    """HF ``tokenizers`` (the reference). ``encode`` returns ``int32[n]``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))

    def encode(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    encode.reference = tok  # type: ignore[attr-defined]
    return Anchor("hf", encode, version=_version("tokenizers"))


def gigatoken(path: Path) -> Anchor:
    """gigatoken 0.10, warmed twice. ``encode`` returns ``uint32[n]``."""
    try:
        import gigatoken as gt

        tok = gt.Tokenizer(str(path))
        for _ in range(2):
            tok.encode("warm up <|im_start|>user\nhello world\n\n  def f(x):\t return 1234<|im_end|>\n" * 50)
    except Exception as e:  # a missing or refusing engine is a reported gap, not a crash
        return Anchor("gigatoken", None, f"{type(e).__name__}: {e}", _version("gigatoken"))
    return Anchor("gigatoken", tok.encode, version=_version("gigatoken"))


def fastokens(path: Path) -> Anchor:
    """fastokens 0.3.5, segment cache off. ``encode`` returns ``uint32[n]``; may be unsupported."""
    try:
        import fastokens as ft

        tok = ft.Tokenizer.from_file(str(path))
        tok.enable_segment_cache(0)

        def encode(text: str) -> np.ndarray:
            ids, _offsets = tok.encode_batch_flat([text])
            return np.frombuffer(ids, dtype=np.uint32)

        encode("warm up <|im_start|>user\nhello<|im_end|>\n")
    except Exception as e:
        return Anchor("fastokens", None, f"{type(e).__name__}: {e}", _version("fastokens"))
    return Anchor("fastokens", encode, version=_version("fastokens"))


def ours(path: Path, *, add_special_tokens: bool = False) -> Anchor:
    """``toktier_backend.load_tokenizer(path).encode`` (serial). Returns ``int32[n]``."""
    ensure_repo_on_path()
    import toktier_backend as tt

    tok = tt.load_tokenizer(path)

    def encode(text: str) -> np.ndarray:
        return tok.encode(text, add_special_tokens=add_special_tokens)

    return Anchor("ours", encode, version=_version("toktier_backend"))


# -- toktier 0.3.0 -------------------------------------------------------------------------------

class AnchorUnavailable(RuntimeError):
    """An anchor cannot run here; the message says why."""


def toktier_manifest(families: dict[str, Path]):
    """An ``ArtifactManifest`` serving ``families`` (toktier family -> our ``tokenizer.json``) from disk.

    ``repo_id`` and ``revision`` come from toktier's shipped ``artifact_manifest.v1.json`` (provenance
    only); ``local_dir`` is the folder of our file, with its own sha256 and size.
    """
    import toktier
    from toktier.artifacts.manifest import ArtifactManifest

    shipped_path = Path(toktier.__file__).parent / "artifacts" / "tables" / "artifact_manifest.v1.json"
    shipped = json.loads(shipped_path.read_text(encoding="utf-8"))
    mapping = {}
    for family, path in families.items():
        if family not in shipped:
            raise AnchorUnavailable(f"toktier {_version('toktier')} has no family {family!r} in {shipped_path}")
        data = Path(path).read_bytes()
        mapping[family] = {
            "repo_id": shipped[family]["repo_id"],
            "revision": shipped[family]["revision"],
            "local_dir": str(Path(path).parent),
            "files": {"tokenizer.json": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}},
        }
    return ArtifactManifest.from_mapping(mapping, source="bench/anchors.py")


def toktier_tokenizer(family: str, path: Path):
    """``toktier.load(family, device="cpu", manifest=...)`` for our file, staged offline.

    Raises:
        AnchorUnavailable: toktier is not installed, or does not know or accept the family.
    """
    try:
        import toktier
        from toktier.artifacts.sources import LocalDirectorySource
        from toktier.artifacts.store import ArtifactStore
        from toktier.config import Config
    except ImportError as e:
        raise AnchorUnavailable(f"toktier not installed ({e})") from e
    try:
        manifest = toktier_manifest({family: path})
        store = ArtifactStore(manifest, config=Config.resolve().replace(offline=False), source=LocalDirectorySource())
        store.ensure(family)
        return toktier.load(family, device="cpu", manifest=manifest)
    except AnchorUnavailable:
        raise
    except Exception as e:
        raise AnchorUnavailable(f"toktier.load({family!r}) failed: {type(e).__name__}: {e}") from e


class ToktierSession:
    """toktier 0.3.0 session append returning the whole core stream.

    Drives ``tok.encode(transcript, session=<id>)``, the call ANCHORS.md names: the store holds the
    transcript, sees the new one extends it, and re-encodes only what it must. ``append(delta)``
    builds the transcript (the caller of that API holds it; the concatenation is ~0.5 ms at 3M
    chars) and returns ``Encoding.ids`` (a tuple), as ``Session.append`` would in ``all_ids``.
    """

    def __init__(self, family: str, path: Path) -> None:
        self.family = family
        self.version = _version("toktier")
        self._tok = toktier_tokenizer(family, path)
        self._sid = ""
        self._text = ""

    def start(self, text: str) -> Sequence[int]:
        """Open a fresh session holding ``text``; returns its ids."""
        self._sid = f"bench-{uuid.uuid4().hex}"
        self._text = text
        return self._tok.encode(text, session=self._sid).ids

    def append(self, delta: str) -> Sequence[int]:
        """Extend the session by ``delta``; returns the whole core stream (tuple of int)."""
        self._text += delta
        return self._tok.encode(self._text, session=self._sid).ids

    def route(self) -> str:
        """toktier's own name for the path the last call took (``explain(summary=True)``)."""
        try:
            s = self._tok.explain(summary=True)
            return f"{s.get('last_execution_backend')}/{s.get('last_execution_path')}"
        except Exception as e:
            return f"? ({type(e).__name__})"

    def encode(self, text: str) -> np.ndarray:
        """Stateless core-stream encode (for the exactness check)."""
        return np.asarray(self._tok.encode(text, lookup="off").ids, dtype=np.int64)


def toktier_session_append(family: str, path: Path) -> ToktierSession:
    """A toktier 0.3.0 session for ``family`` over our ``path`` (see :class:`ToktierSession`).

    Raises:
        AnchorUnavailable: toktier cannot run this family here.
    """
    return ToktierSession(family, path)


# -- exactness ---------------------------------------------------------------------------------

def first_mismatch(got: Sequence[int] | np.ndarray, want: Sequence[int] | np.ndarray) -> int | None:
    """Index of the first differing id (or the shorter length), ``None`` when equal."""
    a = np.asarray(got, dtype=np.int64)
    b = np.asarray(want, dtype=np.int64)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        return int(diff[0])
    return None if len(a) == len(b) else n


def check_exact(name: str, encode: Encode, reference: Encode, texts: Sequence[str], *, quiet: bool = False) -> int:
    """Compare ``encode`` with ``reference`` on each text; print each mismatch. Returns the count."""
    bad = 0
    for i, text in enumerate(texts):
        got, want = encode(text), reference(text)
        at = first_mismatch(got, want)
        if at is not None:
            bad += 1
            if not quiet:
                print(f"  MISMATCH {name} sample {i} ({len(text)} chars): first diff at id {at}: "
                      f"got {list(np.asarray(got)[at:at + 5])} want {list(np.asarray(want)[at:at + 5])} "
                      f"(len {len(got)} vs {len(want)})")
    return bad


def fresh_str(text: str) -> str:
    """A new ``str`` object equal to ``text``, to give each timed call (untimed copy): CPython caches a
    str's UTF-8 the first time a Rust extension (PyO3) reads it, so a system timed on an object another one
    already read skips its UTF-8 conversion (~0.6 ms per 1M chars). A request decoded from the wire has no
    cache."""
    return "".join((text[:1], text[1:]))


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """``(milliseconds, result)`` of one call, by ``perf_counter_ns``."""
    t0 = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - t0) / 1e6, out


def fmt_ratio(x: float) -> str:
    """A ratio for a table: three significant digits, no exponent (``0.0123``, ``2.35``, ``1290``)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation) or ``None`` for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None
