"""vLLM ``tokenizer_mode="toktier"``: vLLM's ``TokenizerLike`` with exact, session-repaired encoding.

:class:`TokTierTokenizer` implements vLLM's ``TokenizerLike`` protocol (``vllm/tokenizers/protocol.py``,
checked against vLLM 0.33.0) without importing vLLM. Encoding (``encode``, ``__call__``,
``apply_chat_template(tokenize=True)``) goes through the serving core (:mod:`toktier_backend.serving.core`;
a chat whose template and keywords we render as transformers does goes through its chat step, which renders
only what changed since the conversation's previous request, see :meth:`TokTierTokenizer.apply_chat_template`):
a prompt of at least ``min_prefix_chars`` is matched by its prefix to a held session, so an agent's resent
conversation is repaired from the last stable cut instead of re-encoded; every reply may be sampled by the
shadow verifier (a mismatch quarantines the route) and is counted in ``toktier_*`` (``face="vllm"``,
``model="tokenizer"``; vLLM's ``/metrics`` serves the default registry). Everything else
(``decode``, vocab, special tokens, chat-template resolution and rendering) is the Hugging Face tokenizer
vLLM's ``hf`` mode would load (``AutoTokenizer.from_pretrained``), and any attribute this class does not
define is read from (and written to) it, so vLLM's ``HfRenderer`` and Dynamo's vLLM chat processor use it
unchanged.

Exactness: the ids equal the HF tokenizer's own (``hf(text, add_special_tokens=flag)["input_ids"]``). At load
we compare the HF tokenizer's backend (``backend_tokenizer.to_str()``) with the ``tokenizer.json`` we encode
with; if transformers changed it (e.g. a post-processor rebuilt from ``add_bos_token``), we encode with the
backend's own serialization instead. Requests we cannot serve exactly with a plain id list go to HF:
truncation that would cut, ``text_pair``, offsets, tensors, padding, and any other tokenizer keyword.

Registration: ``vllm_plugin.register`` (entry point ``vllm.general_plugins: toktier``) maps the mode to this
class and the renderer to vLLM's ``HfRenderer``. Then ``vllm serve MODEL --tokenizer-mode toktier``.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from toktier_backend.config import cache_dir
from toktier_backend.errors import UnsupportedTokenizer
from toktier_backend.faces import vllm_structured
from toktier_backend.serving.core import DEFAULT_MIN_PREFIX_CHARS, CoreConfig, ServingCore
from toktier_backend.serving.metrics import Origin
from toktier_backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MODE = "toktier"

_OWN = frozenset({"hf", "core", "origin", "_init", "_lock", "_cached"})
# Keywords of HF ``__call__``/``encode`` we serve ourselves when they hold these values; anything else -> HF.
_NEUTRAL_KWARGS = {
    "padding": (False, None, "do_not_pad"),
    "stride": (0,),
    "is_split_into_words": (False,),
    "pad_to_multiple_of": (None,),
    "padding_side": (None,),
    "return_tensors": (None,),
    "return_token_type_ids": (None, False),
    "return_attention_mask": (None, True),
    "return_overflowing_tokens": (False,),
    "return_special_tokens_mask": (False,),
    "return_offsets_mapping": (False,),
    "return_length": (False,),
    "verbose": (True, False),
    "text_target": (None,),
    "text_pair_target": (None,),
}
_TEMPLATE_PASSTHROUGH = ("documents", "chat_template", "add_generation_prompt", "continue_final_message")


def _backend_file(hf: Any, path_or_repo_id: str | Path, revision: str | None, download_dir: str | None) -> Path:
    """A ``tokenizer.json`` whose pipeline is exactly the HF tokenizer's backend.

    The model's own ``tokenizer.json`` when its serialization equals the backend's, or differs only where ids
    are not decided (:func:`~toktier_backend.faces.hf_compat.id_pipeline`: decoder, offset-only keys); then
    shipped and cached guard tables apply; else the backend serialized once into ``$TOKTIER_CACHE_DIR/hf_backend/<sha256>.json`` (atomic write).

    Raises:
        UnsupportedTokenizer: the HF tokenizer has no ``tokenizers`` backend (a slow tokenizer).
    """
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedTokenizer(
            f"{path_or_repo_id}: {type(hf).__name__} has no Hugging Face `tokenizers` backend, so tokenizer_mode="
            f"{MODE!r} cannot encode it exactly. Use --tokenizer-mode hf (or auto)."
        )
    serialized = backend.to_str()
    candidate: Path | None = None
    p = Path(str(path_or_repo_id))
    if p.is_dir() and (p / "tokenizer.json").is_file():
        candidate = p / "tokenizer.json"
    elif p.is_file() and p.name.endswith(".json"):
        candidate = p
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(str(path_or_repo_id), "tokenizer.json", cache_dir=download_dir,
                                           revision=revision)
            candidate = Path(found) if isinstance(found, str) else None
        except Exception:  # offline, no hub package: the backend copy below is just as exact
            candidate = None
    if candidate is not None:
        import tokenizers

        try:
            on_disk = tokenizers.Tokenizer.from_file(str(candidate)).to_str()
            if on_disk == serialized:
                return candidate
            from toktier_backend.faces.hf_compat import id_pipeline

            if id_pipeline(on_disk) == id_pipeline(serialized):  # offsets/decoder only: same ids, shipped tables
                return candidate
        except Exception as e:
            log.warning("%s: not loadable by tokenizers (%s); encoding with the HF backend's serialization", candidate, e)
        else:
            log.warning("%s differs from the pipeline transformers built from it; encoding with the backend's "
                        "serialization (guard tables are computed once for it)", candidate)
    digest = hashlib.sha256(serialized.encode("utf-8")).hexdigest()
    out = cache_dir() / "hf_backend" / f"{digest}.json"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(serialized)
        os.replace(tmp, out)
    return out


class TokTierTokenizer:
    """vLLM ``TokenizerLike``: exact session-repaired encoding, everything else from the HF tokenizer.

    Args:
        hf: the Hugging Face fast tokenizer (``AutoTokenizer.from_pretrained(...)``).
        core: the serving core of our ``Tokenizer`` for the same pipeline (see :func:`_backend_file`), or that
            ``Tokenizer`` alone: then a core is built for it (``CoreConfig`` defaults, and the two below).
        min_prefix_chars: prompts at least this long (chars) are matched to a held session by prefix
            (``$TOKTIER_VLLM_MIN_PREFIX_CHARS``, default 2048); only when a core is built here.
        max_sessions: sessions held, LRU beyond (``$TOKTIER_VLLM_MAX_SESSIONS``, default 256); likewise.
        face: the ``face`` label of its metrics (``vllm``; Dynamo's vLLM chat processor: ``dynamo``).

    Invariant: ``encode(text, add_special_tokens=f) == hf.encode(text, add_special_tokens=f)`` for every text.
    GPT-2: ``encode("hello world") == [31373, 995]``.
    """

    # ------------------------------------------------------------ construction

    def __init__(self, hf: Any, core: ServingCore | Tokenizer, *, min_prefix_chars: int | None = None,
                 max_sessions: int | None = None, face: str = "vllm"):
        object.__setattr__(self, "hf", hf)
        if not isinstance(core, ServingCore):
            env_min = os.environ.get("TOKTIER_VLLM_MIN_PREFIX_CHARS")
            env_max = os.environ.get("TOKTIER_VLLM_MAX_SESSIONS")
            config = CoreConfig(
                tokenizer=str(core.path),
                min_prefix_chars=int(min_prefix_chars if min_prefix_chars is not None
                                     else env_min or DEFAULT_MIN_PREFIX_CHARS),
                max_sessions=int(max_sessions if max_sessions is not None else env_max or 256),
            )
            core = ServingCore.from_config(config, tokenizer=core)
        object.__setattr__(self, "core", core)
        object.__setattr__(self, "origin", Origin(face, "tokenizer"))
        _use_hf_chat_template(core, hf)
        core.register(self.origin, sessions=True)
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_cached", {})
        object.__setattr__(self, "_init", None)

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | Path,
        *args,
        trust_remote_code: bool = False,
        revision: str | None = None,
        download_dir: str | None = None,
        **kwargs,
    ) -> "TokTierTokenizer":
        """Load as vLLM's ``hf`` mode does (``AutoTokenizer.from_pretrained(path, *args, trust_remote_code=...,
        revision=..., cache_dir=download_dir, **kwargs)``), then our tokenizer for the same pipeline.

        Raises:
            UnsupportedTokenizer: no fast (``tokenizers``) backend, or our loader refuses the file.
        """
        from transformers import AutoTokenizer

        import toktier_backend as tt

        def load():
            hf = AutoTokenizer.from_pretrained(
                path_or_repo_id, *args, trust_remote_code=trust_remote_code, revision=revision,
                cache_dir=download_dir, **kwargs,
            )
            return hf, tt.load_tokenizer(_backend_file(hf, path_or_repo_id, revision, download_dir))

        key = vllm_structured.load_key(path_or_repo_id, args, dict(
            trust_remote_code=trust_remote_code, revision=revision, download_dir=download_dir, **kwargs))
        # one load per process: copies and unpickling share the HF tokenizer, ours and its serving core
        hf, core = vllm_structured.shared_load(key, lambda: (lambda h, t: (h, cls(h, t).core))(*load()))
        tok = cls(hf, core)
        object.__setattr__(tok, "_init", (str(path_or_repo_id), args, dict(
            trust_remote_code=trust_remote_code, revision=revision, download_dir=download_dir, **kwargs)))
        return tok

    # isinstance(tok, PreTrainedTokenizerFast) holds: structured-output backends accept it (vllm_structured)
    __class__ = property(vllm_structured.presented_class, vllm_structured.assign_class)

    def __copy__(self) -> "TokTierTokenizer":
        """A second handle on the same loaded state (HF tokenizer, our tokenizer, sessions): no load."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict) -> "TokTierTokenizer":
        """As :meth:`__copy__`: the loaded state is read-only but for the session cache, which locks itself."""
        return self.__copy__()

    def __reduce__(self):
        if self._init is None:
            raise TypeError("TokTierTokenizer built directly cannot be pickled; use from_pretrained")
        path, args, kwargs = self._init
        return _rebuild, (path, args, kwargs)

    # ------------------------------------------------------------ delegation

    def __getattr__(self, name: str) -> Any:
        hf = self.__dict__.get("hf")
        if hf is None or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        return getattr(hf, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "__class__":
            vllm_structured.assign_class(self, value)
        elif name in _OWN:
            object.__setattr__(self, name, value)
        else:  # e.g. Dynamo sets tokenizer.chat_template: it belongs to the HF tokenizer that renders
            setattr(self.hf, name, value)

    def __repr__(self) -> str:
        return f"TokTierTokenizer({getattr(self.hf, 'name_or_path', '?')!r}, engine={self.core.tokenizer.engine.name})"

    def _memo(self, name: str, compute):
        cached = self._cached
        if name not in cached:
            cached[name] = compute()
        return cached[name]

    # ------------------------------------------------------------ TokenizerLike: properties

    def num_special_tokens_to_add(self) -> int:
        return self.hf.num_special_tokens_to_add()

    @property
    def all_special_tokens(self) -> list[str]:
        return self._memo("all_special_tokens", lambda: list(self.hf.all_special_tokens))

    @property
    def all_special_ids(self) -> list[int]:
        return self._memo("all_special_ids", lambda: list(self.hf.all_special_ids))

    @property
    def bos_token_id(self) -> int:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self.hf.eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self.hf.pad_token_id

    @property
    def is_fast(self) -> bool:
        return bool(getattr(self.hf, "is_fast", True))

    @property
    def vocab_size(self) -> int:
        return self.hf.vocab_size

    @property
    def max_token_id(self) -> int:
        """Largest id: of the vocab (added tokens included) or ``vocab_size - 1`` (as vLLM's cached HF tokenizer)."""

        def compute() -> int:
            m = max(self.get_vocab().values())
            try:
                m = max(m, int(self.hf.vocab_size) - 1)
            except (NotImplementedError, TypeError):
                pass
            return m

        return self._memo("max_token_id", compute)

    @property
    def max_chars_per_token(self) -> int:
        return self._memo("max_chars_per_token", lambda: max(len(t) for t in self.get_vocab()))

    @property
    def truncation_side(self) -> str:
        return self.hf.truncation_side

    def __hash__(self) -> int:
        return hash(id(self))

    def __len__(self) -> int:
        return self._memo("len", lambda: len(self.hf))

    def get_vocab(self) -> dict[str, int]:
        return self._memo("vocab", self.hf.get_vocab)

    def get_added_vocab(self) -> dict[str, int]:
        return self.hf.get_added_vocab()

    # ------------------------------------------------------------ TokenizerLike: encoding (ours)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """Our ids of ``text`` (session-repaired when long), or ``None`` for non-``str`` input."""
        if not isinstance(text, str):
            return None
        return self.core.encode(self.origin, text, add_special_tokens=add_special_tokens, what="prompt").ids.tolist()

    def _fits(self, ids: list[int], truncation: Any, max_length: int | None) -> bool:
        """True when HF's truncation would leave ``ids`` unchanged."""
        if truncation in (None, False, "do_not_truncate"):
            return True
        limit = max_length if max_length is not None else getattr(self.hf, "model_max_length", None)
        return limit is None or len(ids) <= int(limit)

    def encode(
        self,
        text: str,
        truncation: bool | None = None,
        max_length: int | None = None,
        add_special_tokens: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Ids of ``text``: equals HF ``encode(text, add_special_tokens=..., truncation=..., max_length=...)``.

        Served by us (with a prefix-found session for long prompts) unless truncation would cut or another
        keyword asks for more than a plain id list; then HF serves it.
        """
        if _neutral(kwargs) and not kwargs.get("text_pair"):
            ids = self._ids(text, add_special_tokens)
            if ids is not None and self._fits(ids, truncation, max_length):
                return ids
        return self.hf.encode(text, truncation=truncation, max_length=max_length,
                              add_special_tokens=add_special_tokens, **kwargs)

    def __call__(
        self,
        text: str | list[str],
        text_pair: str | None = None,
        add_special_tokens: bool = True,
        truncation: bool = False,
        max_length: int | None = None,
        **kwargs: Any,
    ):
        """HF ``__call__``: a ``BatchEncoding`` with ``input_ids`` and ``attention_mask``, ours for ``str`` or
        ``list[str]`` text without ``text_pair``/offsets/tensors/padding; HF's otherwise."""
        if text_pair is None and _neutral(kwargs) and self._plain_model_inputs():
            texts = [text] if isinstance(text, str) else text
            if isinstance(texts, list) and all(isinstance(t, str) for t in texts):
                rows = [self._ids(t, add_special_tokens) for t in texts]
                if all(self._fits(r, truncation, max_length) for r in rows):
                    return self._batch_encoding(rows[0] if isinstance(text, str) else rows, kwargs)
        return self.hf(text, text_pair=text_pair, add_special_tokens=add_special_tokens, truncation=truncation,
                       max_length=max_length, **kwargs)

    def apply_chat_template(
        self,
        messages: list[Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the HF tokenizer's chat template (transformers renders it in a jinja2
        ``ImmutableSandboxedEnvironment``), then, with ``tokenize=True``, encode the text with
        ``add_special_tokens=False`` through a prefix-found session, as HF's ``apply_chat_template`` would.

        Accepts HF's keyword ``conversation=`` for ``messages`` (vLLM's renderer passes it so). With
        ``return_dict=True`` (transformers 5's default) a ``BatchEncoding``; with
        ``return_assistant_tokens_mask``, tensors, padding, truncation, batched conversations or
        ``tokenizer_kwargs``, HF does the whole call.
        """
        if messages is None:
            messages = kwargs.pop("conversation", None)
        tokenize = kwargs.pop("tokenize", True)
        default_dict = _param_default(self.hf.apply_chat_template, "return_dict", False)
        return_dict = kwargs.pop("return_dict", default_dict)
        hf_only = (
            kwargs.get("return_assistant_tokens_mask") or kwargs.get("return_tensors") or kwargs.get("padding")
            or kwargs.get("truncation") or kwargs.get("tokenizer_kwargs") or kwargs.get("sanitize_control_tokens")
            or (messages and isinstance(messages[0], (list, tuple)))
        )
        if not tokenize or hf_only or (return_dict and not self._plain_model_inputs()):
            return self.hf.apply_chat_template(messages, tools=tools, tokenize=tokenize, return_dict=return_dict,
                                               **kwargs)
        kwargs.pop("max_length", None)  # only meaningful with truncation, which HF serves
        ids = self._chat_ids(messages, tools, kwargs)
        if ids is None:  # a template or keywords we do not render as transformers does: it renders
            text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
            ids = self._ids(text, False)
        return self._batch_encoding(ids, {}) if return_dict else ids

    def _chat_ids(self, messages: Any, tools: Any, kwargs: dict[str, Any]) -> list[int] | None:
        """Ids of the chat through the core's chat step (``ServingCore.chat``, no key: the conversation is
        found again by its first messages), or ``None`` when transformers must render it: the template
        transformers would pick (``get_chat_template(chat_template, tools)``) is not the core's, the
        messages are not a non-empty list of dicts of JSON values (checked one level deep), ``tools`` holds
        callables, ``continue_final_message`` is neither a bool nor a field name or comes with ``add_generation_prompt``, or
        ``sanitize_control_tokens`` is set. Every other keyword is a template variable, as in
        transformers' ``render_jinja_template``; the special tokens are the HF tokenizer's
        ``special_tokens_map`` (:func:`_use_hf_chat_template`)."""
        tpl = self.core.chat_template
        if tpl is None or not isinstance(messages, list) or not messages or not all(map(_plain_message, messages)):
            return None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            return None
        kw = dict(kwargs)
        agp, cont = kw.pop("add_generation_prompt", False), kw.pop("continue_final_message", False)
        if not isinstance(agp, bool) or not isinstance(cont, (bool, str)) or (agp and cont) or kw.pop("sanitize_control_tokens", False):
            return None
        documents = kw.pop("documents", None)
        try:
            chosen = self.hf.get_chat_template(kw.pop("chat_template", None), tools)
        except ValueError:  # no template: transformers raises its own error
            return None
        if chosen != tpl.source:
            return None
        return self.core.chat(self.origin, messages, tools=tools, documents=documents, add_generation_prompt=agp,
                              continue_final_message=cont, chat_template_kwargs=kw,
                              add_special_tokens=False).ids.tolist()

    # ------------------------------------------------------------ TokenizerLike: the rest (HF)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        return self.hf.convert_tokens_to_ids(tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.hf.convert_tokens_to_string(tokens)

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)

    def convert_ids_to_tokens(self, ids: Sequence[int], skip_special_tokens: bool = False) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ helpers

    def _plain_model_inputs(self) -> bool:
        return list(getattr(self.hf, "model_input_names", [])) == ["input_ids", "attention_mask"]

    def _batch_encoding(self, ids: list[int] | list[list[int]], kwargs: dict[str, Any]):
        from transformers import BatchEncoding

        rows = ids if ids and isinstance(ids[0], list) else None
        data: dict[str, Any] = {"input_ids": ids}
        if kwargs.get("return_attention_mask", True) is not False:
            data["attention_mask"] = [[1] * len(r) for r in rows] if rows is not None else [1] * len(ids)
        return BatchEncoding(data)


def _use_hf_chat_template(core: ServingCore, hf: Any) -> None:
    """Give ``core`` the HF tokenizer's default chat template and its ``special_tokens_map`` (what
    transformers renders with), so ``apply_chat_template`` can take the core's chat step; nothing when the
    tokenizer has no string template (then transformers renders every chat)."""
    try:
        source = hf.get_chat_template()
    except (ValueError, AttributeError, TypeError):
        return
    if isinstance(source, str) and source:
        try:
            core.use_chat_template(source, dict(getattr(hf, "special_tokens_map", {}) or {}))
        except UnsupportedTokenizer as e:  # our sandbox cannot compile it: transformers keeps rendering
            log.warning("chat template not served by the core (transformers renders it): %s", e)


_PLAIN = (str, int, float, bool, type(None), list, dict)


def _plain_message(m: Any) -> bool:
    return type(m) is dict and all(type(v) in _PLAIN for v in m.values())


def _neutral(kwargs: dict[str, Any]) -> bool:
    """True when every keyword holds a value that does not change a plain encode."""
    return all(k in _NEUTRAL_KWARGS and v in _NEUTRAL_KWARGS[k] for k, v in kwargs.items())


def _param_default(fn: Any, name: str, fallback: Any) -> Any:
    try:
        p = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return fallback
    return fallback if p is None or p.default is inspect.Parameter.empty else p.default


def _rebuild(path: str, args: tuple, kwargs: dict[str, Any]) -> TokTierTokenizer:
    return TokTierTokenizer.from_pretrained(path, *args, **kwargs)
