"""What a tokenizer file is: parsed once at load, checked, and described for the rest of the pipeline.

:class:`TokenizerSpec` holds the frozen HF reference, the added tokens, the post-processor's constant
prefix/suffix ids, the per-id *normalized byte length* table that turns ids into token end offsets, and the
structural facts (normalizer, pre-tokenizer) from which ``pipeline.cuts`` derives the family.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers

from toktier_backend.errors import UnsupportedTokenizer

_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def resolve_path(spec: str | os.PathLike) -> Path:
    """A local ``tokenizer.json`` for ``spec``: a file, a folder holding one, or a Hugging Face Hub id.

    Raises:
        UnsupportedTokenizer: nothing found locally and the Hub download failed (no network, bad id).
    """
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return p / "tokenizer.json"
        raise UnsupportedTokenizer(f"folder {str(p)!r} holds no tokenizer.json")
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(str(spec), "tokenizer.json"))
    except Exception as e:
        raise UnsupportedTokenizer(
            f"{str(spec)!r} is neither a local tokenizer.json/folder nor a reachable Hub id: {e}"
        ) from e


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map (openai/gpt-2 ``encoder.py``), used by ByteLevel:
    ``{byte 0..255: one char}``, 256 distinct chars (``0x20`` -> ``"Ġ"``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass(frozen=True)
class AddedToken:
    content: str
    id: int
    special: bool
    normalized: bool
    lstrip: bool
    rstrip: bool
    single_word: bool


@dataclass
class TokenizerSpec:
    """A loaded, checked tokenizer file.

    Attributes:
        path: the tokenizer.json file.
        sha256: hex digest of the file bytes (cache key of the guard set).
        config: the parsed JSON.
        reference: the frozen HF ``tokenizers.Tokenizer`` (oracle and fallback).
        added: the added tokens.
        prefix_ids, suffix_ids: ``np.ndarray[int32]`` the post-processor puts around the body with
            ``add_special_tokens=True`` (``None`` when it is not a constant prefix/suffix).
        byte_level: whether the model's vocabulary is in GPT-2's byte-level alphabet.
        token_nbytes: ``np.ndarray[int32] (vocab,)``: UTF-8 bytes of *normalized* text each id covers;
            ``None`` when it could not be proven (then sessions cannot locate cuts in their ids).
    """

    path: Path
    sha256: str
    config: dict
    reference: tokenizers.Tokenizer
    added: list[AddedToken]
    prefix_ids: np.ndarray | None = None
    suffix_ids: np.ndarray | None = None
    byte_level: bool = False
    #: The normalizer holds a Unicode normalization form (NFC/NFD/NFKC/NFKD): it reorders and composes marks.
    unicode_normalizer: bool = False
    token_nbytes: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)
    _normalizer_touches_ascii: bool = True
    _normalizer_is_per_char: bool = False
    _normalizer_is_nfc: bool = False
    _added_re: "re.Pattern | None" = None

    # ------------------------------------------------------------------ normalized lengths
    def normalized_nbytes(self, text: str) -> int:
        """UTF-8 bytes of ``text`` as the model sees it: each segment between added tokens normalized on
        its own, added tokens as they are (HF ``AddedVocabulary::extract_and_normalize``). Bytes, not chars.

        Equals ``token_nbytes[encode(text)].sum()`` for every text (proven on the canary at load, and
        re-checked on every repair). Segment-wise matters for composing normalizers: under NFC,
        ``"<|im_end|>" + U+0338`` stays two segments, while NFC of the whole string would compose
        ``">" + U+0338`` into ``"≯"``.
        """
        if not self._normalizer_touches_ascii and text.isascii():
            return len(text)  # one byte per ASCII char, which the normalizer leaves as it is
        norm = self.reference.normalizer
        if norm is None:
            return len(text.encode("utf-8"))
        if self._normalizer_is_nfc and _nfc_identity(text):  # Qwen: most agent text is NFC already
            return len(text.encode("utf-8"))
        if self._added_re is None or self._normalizer_is_per_char:
            return len(norm.normalize_str(text).encode("utf-8"))
        total, pos = 0, 0
        for m in self._added_re.finditer(text):
            total += len(norm.normalize_str(text[pos : m.start()]).encode("utf-8")) + len(m.group().encode("utf-8"))
            pos = m.end()
        return total + len(norm.normalize_str(text[pos:]).encode("utf-8"))

    @property
    def has_truncation_or_padding(self) -> bool:
        return bool(self.config.get("truncation")) or bool(self.config.get("padding"))


def walk_components(node: dict | None) -> list[dict]:
    """Flatten nested ``Sequence`` normalizers/pre-tokenizers/decoders of a ``tokenizer.json`` into their
    leaf components, in order (``[]`` for ``None``). Used by ``pipeline/cuts`` and ``gpu/tables``."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        kids = node.get("normalizers") or node.get("pretokenizers") or node.get("processors") or []
        return [leaf for k in kids for leaf in walk_components(k)]
    return [node]


def load_spec(path: str | os.PathLike) -> TokenizerSpec:
    """Parse and check a tokenizer.json.

    Raises:
        UnsupportedTokenizer: malformed JSON (names file, line and column), or HF refuses the file.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UnsupportedTokenizer(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except UnicodeDecodeError as e:  # binary (a pickle, an archive): never parsed further
        raise UnsupportedTokenizer(f"{path}: not a JSON text file (byte {e.start} is not UTF-8): {e.reason}") from e
    if not isinstance(config, dict) or "model" not in config:
        raise UnsupportedTokenizer(f"{path}: not a Hugging Face tokenizer.json (no 'model' section)")
    try:
        reference = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:
        raise UnsupportedTokenizer(f"{path}: Hugging Face tokenizers cannot load it: {e}") from e
    added = [
        AddedToken(
            content=a["content"], id=int(a["id"]), special=bool(a.get("special", False)),
            normalized=bool(a.get("normalized", False)), lstrip=bool(a.get("lstrip", False)),
            rstrip=bool(a.get("rstrip", False)), single_word=bool(a.get("single_word", False)),
        )
        for a in config.get("added_tokens") or []
    ]
    spec = TokenizerSpec(path=path, sha256=hashlib.sha256(raw).hexdigest(), config=config,
                         reference=reference, added=added)
    leaves = walk_components(config.get("pre_tokenizer")) + walk_components(config.get("decoder"))
    spec.byte_level = any(leaf.get("type") == "ByteLevel" for leaf in leaves)
    spec._normalizer_touches_ascii = _normalizer_touches_ascii(config.get("normalizer"))
    spec._normalizer_is_per_char = _normalizer_is_per_char(config.get("normalizer"))
    norm_types = [leaf.get("type") for leaf in walk_components(config.get("normalizer"))]
    spec._normalizer_is_nfc = norm_types == ["NFC"]
    spec.unicode_normalizer = any(t in ("NFC", "NFD", "NFKC", "NFKD") for t in norm_types)
    contents = sorted({a.content for a in added if a.content}, key=len, reverse=True)
    if contents:  # leftmost, longest first: Python's alternation tries in order
        spec._added_re = re.compile("|".join(map(re.escape, contents)))
    _derive_post_processor(spec)
    _derive_token_nbytes(spec)
    return spec


def _normalizer_is_per_char(norm) -> bool:
    """True when the normalizer maps each char on its own (``Replace`` of one char by a string), so
    normalizing across an added-token boundary equals normalizing each segment."""
    leaves = walk_components(norm)
    return bool(leaves) and all(
        leaf.get("type") == "Replace" and len((leaf.get("pattern") or {}).get("String") or "") == 1 for leaf in leaves
    )


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _nfc_identity(text: str) -> bool:
    """Is HF's NFC (and NFC of every segment between added tokens) the identity on ``text``? Decided
    with Python's ``unicodedata`` (C quick check, much cheaper than ``normalizer.normalize_str``:
    ``docs/design/pipeline.md``) only when every non-ASCII char is assigned in Python's Unicode database:
    by the Unicode Normalization Stability Policy (unicode.org/policies/stability_policy.html), a string
    in NFC that holds only characters assigned in version V stays in NFC in every later version, so the
    answer holds for HF's (newer or equal) tables; an older HF table treats chars it lacks as inert
    starters, which keeps the identity. NFC is closed under substrings (removing a prefix or suffix
    cannot unblock a composition or break canonical order), so each segment between added tokens is
    NFC too. ``False`` means "not proven": the caller normalizes."""
    if not unicodedata.is_normalized("NFC", text):
        return False
    return all(unicodedata.category(c) != "Cn" for c in set(_NON_ASCII.findall(text)))


def _normalizer_touches_ascii(norm) -> bool:
    """False when the normalizer is provably the identity on ASCII text (NFC/NFD/NFKC/NFKD only)."""
    return any(leaf.get("type") not in ("NFC", "NFD", "NFKC", "NFKD") for leaf in walk_components(norm))


_PROBES = ("", "a", "hello world", " x\n\ny", "1234", "<|im_start|>user")


def _derive_post_processor(spec: TokenizerSpec) -> None:
    """Find the constant ids the post-processor adds around the body (e.g. Llama 3's BOS).

    Checked on several probes: ``encode(p, True) == prefix + encode(p, False) + suffix`` for all of them;
    otherwise ``prefix_ids`` stays ``None`` and ``add_special_tokens=True`` requests take the reference.
    """
    ref = spec.reference
    with_sp = ref.encode("", add_special_tokens=True).ids
    pre = suf = None
    for k in range(len(with_sp) + 1):
        cand_pre, cand_suf = with_sp[:k], with_sp[k:]
        if all(ref.encode(p, add_special_tokens=True).ids == cand_pre + ref.encode(p, add_special_tokens=False).ids + cand_suf
               for p in _PROBES):
            pre, suf = cand_pre, cand_suf
            break
    if pre is None:
        spec.notes.append("post-processor is not a constant prefix/suffix: add_special_tokens=True uses the reference")
        return
    spec.prefix_ids = np.asarray(pre, dtype=np.int32)
    spec.suffix_ids = np.asarray(suf, dtype=np.int32)


def _derive_token_nbytes(spec: TokenizerSpec) -> None:
    """Per-id normalized UTF-8 length. Byte-level vocab chars are one byte each; byte-fallback tokens
    ``<0xHH>`` are one byte; added tokens are their content. Proven on the canary by ``admission``."""
    vocab = spec.reference.get_vocab(with_added_tokens=True)
    n = max(vocab.values()) + 1
    table = np.zeros(n, dtype=np.int32)
    b2u = set(bytes_to_unicode().values()) if spec.byte_level else None
    added_ids = {a.id: a.content for a in spec.added}
    for tok, i in vocab.items():
        if i in added_ids:
            table[i] = len(added_ids[i].encode("utf-8"))
        elif b2u is not None:
            if not all(ch in b2u for ch in tok):
                spec.notes.append(f"token {tok!r} is outside the byte-level alphabet: no offsets")
                return
            table[i] = len(tok)
        elif _BYTE_FALLBACK.match(tok):
            table[i] = 1
        else:
            table[i] = len(tok.encode("utf-8"))
    for a in spec.added:  # added tokens that are not normalized must survive the normalizer unchanged
        if spec.reference.normalizer is not None and spec.reference.normalizer.normalize_str(a.content) != a.content:
            spec.notes.append(f"normalizer changes added token {a.content!r}: no offsets")
            return
    spec.token_nbytes = table
