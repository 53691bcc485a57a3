"""The TensorRT-LLM ensemble ``preprocessing`` contract, served exactly and with session repair.

A drop-in for ``NVIDIA/TensorRT-LLM`` ``triton_backend/all_models/inflight_batcher_llm/preprocessing``
(text-only): the same tensor names, dtypes and shapes, the same defaults, the same word-list format.
What changes is how ``QUERY`` becomes ids: our exact tokenizer, and, when the ensemble request carries a
correlation ID, a session that re-encodes only the changed tail of a resent conversation.
``model_repository/preprocessing/1/model.py`` turns tensors into one :meth:`PreprocessingHandler.execute`.

Inputs (batch dimension first; one request may carry ``b`` rows):
    QUERY                  TYPE_STRING [b, 1]   the prompt (UTF-8)
    REQUEST_OUTPUT_LEN     TYPE_INT32  [b, 1]   passed through
    DECODER_QUERY          TYPE_STRING [b, 1]   optional (encoder-decoder models)
    BAD_WORDS_DICT         TYPE_STRING [b, n]   optional
    STOP_WORDS_DICT        TYPE_STRING [b, n]   optional
    EMBEDDING_BIAS_WORDS   TYPE_STRING [b, n]   optional, with EMBEDDING_BIAS_WEIGHTS TYPE_FP32 [b, n]
    END_ID, PAD_ID         TYPE_INT32  [b, 1]   optional: default the tokenizer's eos / pad id
    PROMPT_TABLE_EXTRA_ID  TYPE_UINT64 [b, 1]   optional (p-tuning KV-cache reuse)
    IMAGE_BYTES, IMAGE_URL, IMAGES, VIDEO_BYTES  optional, refused (InvalidRequest): text prompts only
Outputs:
    INPUT_ID                  TYPE_INT32 [b, L]    HF ``encode(query, add_special_tokens=flag).ids``, right-padded
                                                   to the longest row with the tokenizer's pad id
    REQUEST_INPUT_LEN         TYPE_INT32 [b, 1]    ids per row
    DECODER_INPUT_ID          TYPE_INT32 [b, Ld]   DECODER_QUERY's ids, or ``[[pad_id]]`` without one
    REQUEST_DECODER_INPUT_LEN TYPE_INT32 [b, 1]
    BAD_WORDS_IDS             TYPE_INT32 [b, 2, W] row 0: the words' ids concatenated, 0-padded; row 1: cumulative
    STOP_WORDS_IDS            TYPE_INT32 [b, 2, W] word ends, -1-padded (``[b, 2, 0]`` without a list)
    EMBEDDING_BIAS            TYPE_FP32  [b, V]    bias per vocab id (``[b, 0]`` without words)
    REQUEST_OUTPUT_LEN        TYPE_INT32 [b, 1]    the input, unchanged
    OUT_END_ID, OUT_PAD_ID    TYPE_INT32 [b, 1]
    OUT_PROMPT_TABLE_EXTRA_IDS TYPE_UINT64 [b, L]  only with PROMPT_TABLE_EXTRA_ID: the row's extra id where
                                                   ``INPUT_ID >= vocab_size`` (without added tokens), else 0
    ROUTE                     TYPE_STRING [b, 1]   ours, not in the original: the repair route (``new``, ``append``,
                                                   ``edit``, ``noop``, ``full``, ``reference``, ``busy``; ``encode``
                                                   without a session), as ``toktier_session`` reports it
    KEEP                      TYPE_INT32 [b, 1]    ours: ids of the session's previous prompt still valid (0 if none)

Semantics kept from the original (``model.py`` there, documented in its ``_to_word_list_format``):

- ``QUERY`` and ``DECODER_QUERY`` use the model parameter ``add_special_tokens`` (default true).
- Words in BAD/STOP lists are encoded with ``add_special_tokens=False``; a word with no ids is skipped.
  ``W = max(1, longest row)`` when a list is given.
- Embedding-bias words are encoded with ``add_special_tokens=True`` (the original calls ``encode(word)``);
  ``V`` is the vocabulary size including added tokens; weights of repeated ids add up.
- The end id is the first id of the eos token; the pad id that of the pad token, else the eos token.

Sessions: a row is served from a session when the request has a correlation ID and ``b == 1``; the
sequence START flag replaces the session, END frees it. Without a correlation ID (or for ``b > 1``) each
row is a full encode. Either way the ids are the same.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Hashable, Mapping

import numpy as np

import toktier_backend as tt
from toktier_backend.errors import InvalidRequest

from toktier_backend.serving.prefix_sessions import SessionCache
from toktier_backend.faces import trtllm_config
from toktier_backend.faces.parameters import DEFAULT_TOKENIZER, is_unfilled, tokenizer_spec

log = logging.getLogger(__name__)

INPUTS = (
    "QUERY", "REQUEST_OUTPUT_LEN", "DECODER_QUERY", "BAD_WORDS_DICT", "STOP_WORDS_DICT",
    "EMBEDDING_BIAS_WORDS", "EMBEDDING_BIAS_WEIGHTS", "END_ID", "PAD_ID",
) + trtllm_config.EXTRA_INPUTS
ENSEMBLE_EXAMPLE_REPOSITORY = Path(__file__).resolve().parent / "trtllm_ensemble"
"""The example repository served by ``toktier serve --with-ensemble``: ``ensemble`` (TensorRT-LLM's input names
and step-1 mapping) and ``tensorrt_llm``, a CPU stand-in that echoes what it receives."""

OUTPUTS = (
    "INPUT_ID", "REQUEST_INPUT_LEN", "DECODER_INPUT_ID", "REQUEST_DECODER_INPUT_LEN", "BAD_WORDS_IDS",
    "STOP_WORDS_IDS", "EMBEDDING_BIAS", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID",
)
OPTIONAL_OUTPUTS = ("OUT_PROMPT_TABLE_EXTRA_IDS",)
"""Present only when the request sends ``PROMPT_TABLE_EXTRA_ID`` (as the original)."""
DIAGNOSTIC_OUTPUTS = ("ROUTE", "KEEP")

_TRUE = ("true", "1", "t", "y", "yes")
_FALSE = ("false", "0", "f", "n", "no")


def parse_bool(value: str | None, default: bool = True) -> bool:
    """A config string as the original reads ``add_special_tokens``: true/1/t/y/yes, false/0/f/n/no; else
    ``default`` (unset, empty, or an unfilled ``${...}`` template)."""
    v = (value or "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    if v and not v.startswith("${"):
        log.warning("add_special_tokens=%r is not a boolean; using %s", value, default)
    return default


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value or None
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"] or None
    return None


def special_tokens_from_config(tokenizer_path: Path) -> dict[str, str]:
    """``eos_token``, ``pad_token``, ``bos_token``, … from ``tokenizer_config.json`` beside the file (HF
    layout), as strings; ``{}`` when there is none."""
    cfg_path = tokenizer_path.parent / "tokenizer_config.json"
    if not cfg_path.is_file():
        return {}
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("%s: not readable JSON (%s); special tokens not taken from it", cfg_path, e)
        return {}
    out = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        content = _token_content(cfg.get(name))
        if content is not None:
            out[name] = content
    return out


class PreprocessingHandler:
    """Serves the ``preprocessing`` model for one tokenizer.

    Args:
        tokenizer: a core ``toktier_backend.Tokenizer``.
        name: how error messages name the tokenizer.
        add_special_tokens: HF ``add_special_tokens`` for ``QUERY`` and ``DECODER_QUERY``.
        eos_token, pad_token: token strings; ``None`` = from ``tokenizer_config.json`` beside the file,
            else (eos) the only special added token of the file, if it has exactly one (GPT-2:
            ``<|endoftext|>``), else unknown: requests must then carry ``END_ID`` (and ``PAD_ID``).
            The pad token defaults to the eos token, as in the original.
        max_text_bytes: cap on one ``QUERY`` element, in UTF-8 bytes.
        cache: the session cache (default: a new :class:`SessionCache` with its defaults).

    Raises:
        UnsupportedTokenizer: an explicitly named eos/pad token encodes to no id.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str = "tokenizer",
        add_special_tokens: bool = True,
        eos_token: str | None = None,
        pad_token: str | None = None,
        max_text_bytes: int = 16 * 1024 * 1024,
        cache: SessionCache | None = None,
    ):
        self.tokenizer = tokenizer
        self.name = name
        self.add_special_tokens = bool(add_special_tokens)
        self.max_text_bytes = int(max_text_bytes)
        self.cache = cache if cache is not None else SessionCache(tokenizer)
        from_config = special_tokens_from_config(Path(tokenizer.path))
        eos = eos_token or from_config.get("eos_token") or self._sole_special_token()
        pad = pad_token or from_config.get("pad_token") or eos
        self.eos_token, self.pad_token = eos, pad
        self.end_id = self._first_id(eos, "eos_token")
        self.pad_id = self._first_id(pad, "pad_token")
        self.vocab_size = len(tokenizer.reference.get_vocab(with_added_tokens=True))
        # HF ``tokenizer.vocab_size`` (without added tokens): ids at or above it are prompt-table ids
        self.base_vocab_size = int(tokenizer.reference.get_vocab_size(with_added_tokens=False))

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], **kwargs: Any) -> "PreprocessingHandler":
        """Build from a model config's ``parameters``: ``tokenizer`` (``toktier serve`` substitutes it) or
        TensorRT-LLM's ``tokenizer_dir`` (used when ``tokenizer`` is unset or ``default`` and
        ``tokenizer_dir`` is filled in; neither: :class:`UnsupportedTokenizer`, see
        :func:`toktier_backend.faces.parameters.tokenizer_spec`), ``hf_compat`` (the transformers version
        whose ``AutoTokenizer`` ids to match, default ``4.57``: :mod:`toktier_backend.faces.hf_compat`),
        ``engine`` (``auto``, ``hf`` or a fast engine name), ``add_special_tokens``, ``eos_token``, ``pad_token``,
        ``max_text_bytes``, and the session cache's ``max_sessions``, ``session_ttl_s``."""
        spec = tokenizer_spec(params, trtllm_config.TOKENIZER_KEYS, model="preprocessing")
        if not is_unfilled(params.get("multimodal_model_path")):
            raise tt.UnsupportedTokenizer(
                f"preprocessing: multimodal_model_path={params['multimodal_model_path']!r} is set, but this model "
                f"encodes text prompts only; serve multimodal models with TensorRT-LLM's own preprocessing."
            )
        from toktier_backend.faces import hf_compat
        from toktier_backend.spec import resolve_path

        path = tt.default_tokenizer_path() if spec == DEFAULT_TOKENIZER else resolve_path(spec)
        compat = (params.get("hf_compat") or "").strip()
        engine = (params.get("engine") or "").strip()
        tok = tt.load_tokenizer(hf_compat.derived_file(path, "4.57" if is_unfilled(compat) else compat),
                                engine="auto" if is_unfilled(engine) else engine)

        def opt(key: str) -> str | None:
            v = (params.get(key) or "").strip()
            return None if not v or v.startswith("${") else v

        cache = SessionCache(
            tok,
            max_sessions=int(opt("max_sessions") or 256),
            ttl_s=float(opt("session_ttl_s") or 600.0),
            min_prefix_chars=1 << 62,  # no correlation ID -> full encode: the ensemble keys by correlation ID
        )
        return cls(
            tok,
            name=spec,
            add_special_tokens=parse_bool(params.get("add_special_tokens"), True),
            eos_token=opt("eos_token"),
            pad_token=opt("pad_token"),
            max_text_bytes=int(opt("max_text_bytes") or 16 * 1024 * 1024),
            cache=cache,
            **kwargs,
        )

    # ------------------------------------------------------------ tokenizer facts

    def _sole_special_token(self) -> str | None:
        specials = [t.content for t in self.tokenizer.reference.get_added_tokens_decoder().values() if t.special]
        return specials[0] if len(specials) == 1 else None

    def _first_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) == 0:
            raise tt.UnsupportedTokenizer(f"{what}={token!r} encodes to no id with tokenizer {self.name}")
        return int(ids[0])

    # ------------------------------------------------------------ one request

    def execute(
        self,
        inputs: Mapping[str, np.ndarray | None],
        *,
        correlation_id: Hashable | None = None,
        start: bool = False,
        end: bool = False,
    ) -> dict[str, np.ndarray]:
        """One request: input tensors (batch dimension first) -> output tensors.

        Args:
            inputs: ``{name: np.ndarray or None}`` for :data:`INPUTS`; ``QUERY`` and ``REQUEST_OUTPUT_LEN``
                are required.
            correlation_id: the request's correlation ID (``0``/``""``/``None``: none -> full encode).
            start, end: the sequence START / END flags (replace / free the session).

        Returns:
            ``{name: np.ndarray}`` for :data:`OUTPUTS` (dtypes as in the original config) and
            :data:`DIAGNOSTIC_OUTPUTS`.
            GPT-2, ``QUERY=[["hello world"]]``: ``INPUT_ID == [[31373, 995]]``, ``REQUEST_INPUT_LEN == [[2]]``.

        Raises:
            InvalidRequest: a required input is missing, text is not UTF-8 or over ``max_text_bytes``, bias
                words and weights differ in shape, or no END_ID/PAD_ID is given and the tokenizer has none.
        """
        trtllm_config.refuse_multimodal(inputs)
        query = inputs.get("QUERY")
        if query is None:
            raise InvalidRequest("input 'QUERY' is required (TYPE_STRING, shape [b, 1])")
        query = np.asarray(query, dtype=np.object_).reshape(len(query), -1)
        b = query.shape[0]
        output_len = inputs.get("REQUEST_OUTPUT_LEN")
        if output_len is None:
            raise InvalidRequest("input 'REQUEST_OUTPUT_LEN' is required (TYPE_INT32, shape [b, 1])")
        end_id = self._id_input(inputs.get("END_ID"), self.end_id, "END_ID", "eos_token", b)
        pad_id = self._id_input(inputs.get("PAD_ID"), self.pad_id, "PAD_ID", "pad_token", b)

        use_session = correlation_id not in (None, 0, "") and b == 1
        rows, routes, keeps = [], [], []
        for i in range(b):
            text = self._text(query[i, 0], "QUERY", correlation_id)
            if use_session:
                enc = self.cache.encode(
                    text, key=correlation_id, add_special_tokens=self.add_special_tokens, start=start, end=end
                )
                rows.append(enc.ids)
                routes.append(enc.route)
                keeps.append(enc.reused)
            else:
                rows.append(np.asarray(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens)))
                routes.append("encode")
                keeps.append(0)
        if not use_session and end and correlation_id not in (None, 0, ""):
            self.cache.drop(correlation_id)
        input_id, input_len = self._pad_rows(rows)

        decoder_query = inputs.get("DECODER_QUERY")
        if decoder_query is not None:
            dq = np.asarray(decoder_query, dtype=np.object_).reshape(len(decoder_query), -1)
            drows = [
                np.asarray(self.tokenizer.encode(self._text(dq[i, 0], "DECODER_QUERY", correlation_id),
                                                 add_special_tokens=self.add_special_tokens))
                for i in range(dq.shape[0])
            ]
            decoder_id, decoder_len = self._pad_rows(drows)
        else:
            decoder_id = (pad_id * np.ones((b, 1), np.int32)).astype(np.int32)
            decoder_len = np.ones((b, 1), np.int32)

        extra_ids = trtllm_config.prompt_table_extra_ids(input_id, inputs.get("PROMPT_TABLE_EXTRA_ID"),
                                                          self.base_vocab_size)
        return {
            **({} if extra_ids is None else {"OUT_PROMPT_TABLE_EXTRA_IDS": extra_ids}),
            "INPUT_ID": input_id,
            "REQUEST_INPUT_LEN": input_len,
            "DECODER_INPUT_ID": decoder_id,
            "REQUEST_DECODER_INPUT_LEN": decoder_len,
            "BAD_WORDS_IDS": self.word_list(inputs.get("BAD_WORDS_DICT"), b),
            "STOP_WORDS_IDS": self.word_list(inputs.get("STOP_WORDS_DICT"), b),
            "EMBEDDING_BIAS": self.embedding_bias(
                inputs.get("EMBEDDING_BIAS_WORDS"), inputs.get("EMBEDDING_BIAS_WEIGHTS"), b
            ),
            "REQUEST_OUTPUT_LEN": np.asarray(output_len, dtype=np.int32),
            "OUT_END_ID": end_id,
            "OUT_PAD_ID": pad_id,
            "ROUTE": np.array([[r.encode()] for r in routes], dtype=np.object_),
            "KEEP": np.array([[k] for k in keeps], dtype=np.int32),
        }

    # ------------------------------------------------------------ pieces (public: the tests' subjects)

    def word_list(self, words: np.ndarray | None, batch_size: int) -> np.ndarray:
        """BAD/STOP words -> ``int32[b, 2, W]``: row 0 the ids of all words concatenated (0-padded), row 1
        the cumulative end offset of each word (-1-padded); ``W = max(1, longest row)``. Words with no ids
        are skipped; without a list, ``int32[b, 2, 0]``.

        GPT-2, ``[["hello", " world"]]`` -> ``[[[31373, 995], [1, 2]]]``.
        """
        if words is None:
            return np.empty([batch_size, 2, 0], dtype=np.int32)
        words = np.asarray(words, dtype=np.object_)
        words = words.reshape(len(words), -1)
        flat, offsets = [], []
        for row in words:
            ids_row, offs_row = [], []
            for w in row:
                ids = self.tokenizer.encode(self._text(w, "words list", None), add_special_tokens=False)
                if len(ids) == 0:
                    continue
                ids_row.extend(int(x) for x in ids)
                offs_row.append(len(ids))
            flat.append(ids_row)
            offsets.append(np.cumsum(offs_row).tolist() if offs_row else [])
        pad_to = max(1, max((len(r) for r in flat), default=0))
        out = np.zeros((len(flat), 2, pad_to), dtype=np.int32)
        out[:, 1, :] = -1
        for i, (ids_row, offs_row) in enumerate(zip(flat, offsets)):
            out[i, 0, : len(ids_row)] = ids_row
            out[i, 1, : len(offs_row)] = offs_row
        return out

    def embedding_bias(self, words: np.ndarray | None, weights: np.ndarray | None, batch_size: int) -> np.ndarray:
        """``EMBEDDING_BIAS_WORDS`` / ``WEIGHTS`` -> ``float32[b, V]`` (``V`` = vocab incl. added tokens):
        each word's ids (encoded with ``add_special_tokens=True``, as the original) get its weight added.
        Without words or weights, ``float32[b, 0]``."""
        if words is None or weights is None:
            return np.empty([batch_size, 0], dtype=np.float32)
        words = np.asarray(words, dtype=np.object_)
        weights = np.asarray(weights)
        words = words.reshape(len(words), -1)
        weights = weights.reshape(len(weights), -1)
        if words.shape != weights.shape:
            raise InvalidRequest(
                f"EMBEDDING_BIAS_WORDS has shape {list(words.shape)} but EMBEDDING_BIAS_WEIGHTS has "
                f"{list(weights.shape)}: send one weight per word."
            )
        out = np.zeros((len(words), self.vocab_size), dtype=np.float64)
        for i, (row_w, row_x) in enumerate(zip(words, weights)):
            for w, x in zip(row_w, row_x):
                for tid in self.tokenizer.encode(self._text(w, "EMBEDDING_BIAS_WORDS", None), add_special_tokens=True):
                    out[i, int(tid)] += float(x)
        return out.astype(np.float32)

    # ------------------------------------------------------------ helpers

    def _pad_rows(self, rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad with the tokenizer's pad id (as the original; not the PAD_ID input)."""
        lens = np.array([[len(r)] for r in rows], dtype=np.int32)
        width = int(lens.max()) if len(rows) else 0
        fill = self.pad_id if self.pad_id is not None else 0
        out = np.full((len(rows), width), fill, dtype=np.int32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out, lens

    def _id_input(self, value: np.ndarray | None, default: int | None, name: str, param: str, b: int) -> np.ndarray:
        if value is not None:
            return np.asarray(value, dtype=np.int32).reshape(b, -1)
        if default is None:
            raise InvalidRequest(
                f"no {name} in the request and the tokenizer {self.name} names no {param} (no "
                f"tokenizer_config.json beside it, no single special token). Send {name}, or set the model "
                f"parameter {param!r} in preprocessing/config.pbtxt."
            )
        return np.full((b, 1), default, dtype=np.int32)

    def _text(self, raw: Any, what: str, corr_id: Hashable | None) -> str:
        where = f"correlation ID {corr_id!r}: " if corr_id not in (None, 0, "") else ""
        if isinstance(raw, (bytes, bytearray, np.bytes_)):
            raw = bytes(raw)
            if len(raw) > self.max_text_bytes:
                raise InvalidRequest(
                    f"{where}{what} is {len(raw)} bytes, over max_text_bytes={self.max_text_bytes} (tokenizer "
                    f"{self.name}). Shorten it or raise the model parameter max_text_bytes."
                )
            try:
                return tt.decode_text(raw, what=what)
            except InvalidRequest as e:
                raise InvalidRequest(f"{where}{e} (tokenizer {self.name})") from e
        if isinstance(raw, str):
            return raw
        raise InvalidRequest(f"{where}{what} must be TYPE_STRING (UTF-8 bytes), got {type(raw).__name__}")
