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

Every encode (QUERY, DECODER_QUERY, word lists, bias words) goes through the serving core
(:mod:`toktier_backend.serving.core`): sampled to the shadow verifier, counted in ``toktier_*`` with
``face="trtllm"`` (``model="preprocessing"``; the words' encodes ``model="preprocessing_words"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Hashable, Mapping

import numpy as np

from toktier_backend.config import parse_bool, special_tokens
from toktier_backend.errors import InvalidRequest, ToktierError, UnsupportedTokenizer
from toktier_backend.serving.core import CoreConfig, ServingCore
from toktier_backend.serving.metrics import Origin
from toktier_backend.tokenizer import Tokenizer, default_tokenizer_path, load_tokenizer
from toktier_backend.faces import trtllm_config
from toktier_backend.faces.parameters import DEFAULT_TOKENIZER, is_unfilled, tokenizer_spec

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

FACE = "trtllm"
MODEL = "preprocessing"


class PreprocessingHandler:
    """Serves the ``preprocessing`` model for one tokenizer.

    Args:
        core: the serving core (sessions, verifier, metrics, pool, ``max_text_bytes``), or a bare
            ``Tokenizer`` (then a core with ``CoreConfig``'s defaults is built for it).
        add_special_tokens: HF ``add_special_tokens`` for ``QUERY`` and ``DECODER_QUERY``.
        eos_token, pad_token: token strings; ``None`` = from ``tokenizer_config.json`` beside the file,
            else (eos) the only special added token of the file, if it has exactly one (GPT-2:
            ``<|endoftext|>``), else unknown: requests must then carry ``END_ID`` (and ``PAD_ID``).
            The pad token defaults to the eos token, as in the original.
        face: the ``face`` label of its metrics.

    Raises:
        UnsupportedTokenizer: an explicitly named eos/pad token encodes to no id, or ``tokenizer_config.json``
            is not readable JSON.
    """

    def __init__(
        self,
        core: ServingCore | Tokenizer,
        *,
        add_special_tokens: bool = True,
        eos_token: str | None = None,
        pad_token: str | None = None,
        face: str = FACE,
    ):
        if not isinstance(core, ServingCore):  # a bare tokenizer: a core with the defaults
            core = ServingCore.from_config(CoreConfig(tokenizer=str(core.path)), tokenizer=core)
        self.core = core
        self.tokenizer = core.tokenizer
        self.name = core.name
        self.origin = Origin(face, MODEL)
        self.words_origin = Origin(face, MODEL + "_words")
        core.register(self.origin, sessions=True)
        core.register(self.words_origin, sessions=False)
        self.add_special_tokens = bool(add_special_tokens)
        from_config = special_tokens(self.tokenizer.path)
        eos = eos_token or from_config.get("eos_token") or self._sole_special_token()
        pad = pad_token or from_config.get("pad_token") or eos
        self.eos_token, self.pad_token = eos, pad
        self.end_id = self._first_id(eos, "eos_token")
        self.pad_id = self._first_id(pad, "pad_token")
        self.vocab_size = len(self.tokenizer.reference.get_vocab(with_added_tokens=True))
        # HF ``tokenizer.vocab_size`` (without added tokens): ids at or above it are prompt-table ids
        self.base_vocab_size = int(self.tokenizer.reference.get_vocab_size(with_added_tokens=False))

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], **kwargs: Any) -> "PreprocessingHandler":
        """Build from a model config's ``parameters``: ``tokenizer`` (``toktier serve`` substitutes it) or
        TensorRT-LLM's ``tokenizer_dir`` (used when ``tokenizer`` is unset or ``default`` and
        ``tokenizer_dir`` is filled in; neither: :class:`UnsupportedTokenizer`, see
        :func:`toktier_backend.faces.parameters.tokenizer_spec`), ``hf_compat`` (the transformers version
        whose ``AutoTokenizer`` ids to match, default ``4.57``: :mod:`toktier_backend.faces.hf_compat`),
        ``engine`` (``auto``, ``hf`` or a fast engine name), ``add_special_tokens``, ``eos_token``, ``pad_token``,
        and the serving core's (``CoreConfig.from_parameters``: ``max_text_bytes``, ``max_sessions``,
        ``session_ttl_s``, ``session_budget_bytes``, ``verifier_rate``, ``quarantine_file``, ...).

        Raises:
            UnsupportedTokenizer: no tokenizer configured, a multimodal model, the tokenizer cannot be served,
                or its ``tokenizer_config.json`` is not readable JSON.
            ValueError: a malformed parameter (names it).
        """
        spec = tokenizer_spec(params, trtllm_config.TOKENIZER_KEYS, model="preprocessing")
        if not is_unfilled(params.get("multimodal_model_path")):
            raise UnsupportedTokenizer(
                f"preprocessing: multimodal_model_path={params['multimodal_model_path']!r} is set, but this model "
                f"encodes text prompts only; serve multimodal models with TensorRT-LLM's own preprocessing."
            )
        from toktier_backend.faces import hf_compat
        from toktier_backend.spec import resolve_path

        path = default_tokenizer_path() if spec == DEFAULT_TOKENIZER else resolve_path(spec)
        compat = (params.get("hf_compat") or "").strip()
        engine = (params.get("engine") or "").strip()
        tok = load_tokenizer(hf_compat.derived_file(path, "4.57" if is_unfilled(compat) else compat),
                             engine="auto" if is_unfilled(engine) else engine)

        def opt(key: str) -> str | None:
            v = (params.get(key) or "").strip()
            return None if not v or v.startswith("${") else v

        core = ServingCore.from_config(CoreConfig.from_parameters(params, tokenizer=str(path)), tokenizer=tok)
        return cls(
            core,
            add_special_tokens=parse_bool(params.get("add_special_tokens"), True,
                                          name="model parameter add_special_tokens"),
            eos_token=opt("eos_token"),
            pad_token=opt("pad_token"),
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
            raise UnsupportedTokenizer(f"{what}={token!r} encodes to no id with tokenizer {self.name}")
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
        keyed = correlation_id not in (None, 0, "")
        try:
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
            bias_words, bias_weights = _bias_inputs(inputs.get("EMBEDDING_BIAS_WORDS"),
                                                    inputs.get("EMBEDDING_BIAS_WEIGHTS"))
        except ToktierError as e:
            self.core.refuse(self.origin, e, key=correlation_id if keyed else None, start=start, end=end)
            raise

        use_session = keyed and b == 1
        rows, routes, keeps = [], [], []
        for i in range(b):
            if use_session:
                r = self.core.encode(self.origin, query[i, 0], key=correlation_id,
                                     add_special_tokens=self.add_special_tokens, start=start, end=end, what="QUERY")
                routes.append(r.shown_route)
            else:
                r = self.core.encode_stateless(self.origin, query[i, 0], add_special_tokens=self.add_special_tokens,
                                               what="QUERY")
                routes.append("encode")
            rows.append(r.ids)
            keeps.append(r.keep)
        if not use_session and end and keyed:
            self.core.drop(correlation_id)
        input_id, input_len = self._pad_rows(rows)

        decoder_query = inputs.get("DECODER_QUERY")
        if decoder_query is not None:
            dq = np.asarray(decoder_query, dtype=np.object_).reshape(len(decoder_query), -1)
            drows = [self.core.encode_stateless(self.origin, dq[i, 0], add_special_tokens=self.add_special_tokens,
                                                what="DECODER_QUERY").ids
                     for i in range(dq.shape[0])]
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
            "EMBEDDING_BIAS": self.embedding_bias(bias_words, bias_weights, b),
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
                ids = self._word_ids(w, False, "words list")
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
        words, weights = _bias_inputs(words, weights)
        if words is None or weights is None:
            return np.empty([batch_size, 0], dtype=np.float32)
        out = np.zeros((len(words), self.vocab_size), dtype=np.float64)
        for i, (row_w, row_x) in enumerate(zip(words, weights)):
            for w, x in zip(row_w, row_x):
                for tid in self._word_ids(w, True, "EMBEDDING_BIAS_WORDS"):
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

    def _word_ids(self, word: Any, add_special_tokens: bool, what: str) -> np.ndarray:
        """``int32[n]`` ids of one word, through the core (verified and counted as ``preprocessing_words``)."""
        return self.core.encode_stateless(self.words_origin, word, add_special_tokens=add_special_tokens,
                                          what=what).ids


def _bias_inputs(words: np.ndarray | None, weights: np.ndarray | None):
    """``EMBEDDING_BIAS_WORDS`` / ``WEIGHTS`` as ``[b, n]`` arrays (``None, None`` without either).

    Raises:
        InvalidRequest: their shapes differ.
    """
    if words is None or weights is None:
        return None, None
    words = np.asarray(words, dtype=np.object_)
    weights = np.asarray(weights)
    words = words.reshape(len(words), -1)
    weights = weights.reshape(len(weights), -1)
    if words.shape != weights.shape:
        raise InvalidRequest(
            f"EMBEDDING_BIAS_WORDS has shape {list(words.shape)} but EMBEDDING_BIAS_WEIGHTS has "
            f"{list(weights.shape)}: send one weight per word."
        )
    return words, weights
