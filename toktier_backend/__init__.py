"""toktier_backend: exact, stateful tokenization for LLM serving.

Sessions keep their text, ids and token offsets, and repair only the tail after the last provably stable
cut before the edit; every id equals Hugging Face ``tokenizers``' ``encode(text, add_special_tokens=...)``.
"""

from toktier_backend.tokenizer import (RepairInfo, Session, Tokenizer, decode_text, default_tokenizer_path, load_tokenizer,
                                       tokenizer_path)
from toktier_backend.errors import EngineUnavailable, InvalidRequest, ToktierError, UnknownSession, UnsupportedTokenizer

__version__ = "0.1.0"

__all__ = [
    "EngineUnavailable", "InvalidRequest", "RepairInfo", "Session", "Tokenizer", "ToktierError",
    "UnknownSession", "UnsupportedTokenizer", "decode_text", "default_tokenizer_path", "load_tokenizer", "tokenizer_path",
]
