"""``toktier_backend.config``: the one copy of each small helper (cache/state folders, bool parsing, special
tokens of ``tokenizer_config.json``, stop on signals, the Python stub's environment)."""

from __future__ import annotations

import json
import os
import signal
import sysconfig
from pathlib import Path

import pytest

from toktier_backend import config
from toktier_backend.errors import UnsupportedTokenizer


def test_cache_and_state_dirs(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKTIER_CACHE_DIR", raising=False)
    monkeypatch.delenv("TOKTIER_STATE_DIR", raising=False)
    assert config.cache_dir() == Path.home() / ".cache" / "toktier_backend" == config.state_dir()
    monkeypatch.setenv("TOKTIER_CACHE_DIR", str(tmp_path / "c"))
    assert config.cache_dir() == tmp_path / "c" == config.state_dir()
    assert config.default_quarantine_file() == tmp_path / "c" / "quarantine.json"
    monkeypatch.setenv("TOKTIER_STATE_DIR", str(tmp_path / "s"))
    assert config.default_quarantine_file() == tmp_path / "s" / "quarantine.json"
    assert config.cache_dir() == tmp_path / "c"


@pytest.mark.parametrize("raw, want", [("true", True), ("YES", True), (" 1 ", True), ("t", True), ("on", True),
                                       ("false", False), ("No", False), ("0", False), ("off", False), (b"y", True),
                                       (True, True), (False, False), (1, True), (0, False)])
def test_parse_bool_words(raw, want):
    assert config.parse_bool(raw, not want) is want


@pytest.mark.parametrize("raw", [None, "", "  ", "${add_special_tokens}"])
def test_parse_bool_unset_is_the_default(raw):
    assert config.parse_bool(raw, True) is True and config.parse_bool(raw, False) is False


def test_parse_bool_refuses_anything_else():
    with pytest.raises(ValueError, match="add_special_tokens='maybe'"):
        config.parse_bool("maybe", True, name="add_special_tokens")
    with pytest.raises(ValueError):
        config.parse_bool(2, True)


def test_special_tokens(tmp_path):
    tok = tmp_path / "tokenizer.json"
    assert config.special_tokens(tok) == {} and config.special_tokens(None) == {}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "lstrip": False}, "bos_token": "<s>", "pad_token": None,
        "unk_token": 3, "chat_template": "x"}))
    assert config.special_tokens(tok) == {"eos_token": "<|im_end|>", "bos_token": "<s>"}
    assert config.special_tokens(tmp_path) == config.special_tokens(tok)  # the folder works too
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UnsupportedTokenizer, match="tokenizer_config.json: not readable JSON"):
        config.special_tokens(tok)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(UnsupportedTokenizer, match="expected a JSON object"):
        config.special_tokens(tok)


def test_stop_on_signals_sets_the_event_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with config.stop_on_signals() as stop:
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
    assert signal.getsignal(signal.SIGTERM) is before


def test_stub_environment_puts_this_python_first(tmp_path):
    libdir = sysconfig.get_config_var("LIBDIR")
    base = {"LD_LIBRARY_PATH": f"/usr/lib:{libdir}", "PYTHONPATH": "/x", "PATH": "/bin"}
    env = config.stub_environment([tmp_path], base=base)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep) == [libdir, str(tmp_path), "/usr/lib"]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(config.PACKAGE_ROOT), "/x"]
    assert (config.PACKAGE_ROOT / "toktier_backend" / "config.py").is_file()
    assert env["PATH"].split(os.pathsep)[-1] == "/bin" and base["PYTHONPATH"] == "/x"  # base unchanged
