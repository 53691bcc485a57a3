"""``preprocessing`` ids under the transformers version TensorRT-LLM pins (4.57.x) and under 5.x.

References, both computed by the real library:

- 4.57.1: ``tests/faces/data/hf_compat_4_57.json``, written by ``tests/faces/real/
  hf_compat_reference.py`` in a venv with ``transformers==4.57.1`` (command and versions inside the file);
  CI installs one transformers (5.x), so 4.57's ids are recorded rather than recomputed.
- 5.x: the installed ``transformers.AutoTokenizer`` on the same folder, computed in the test.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from .conftest import REPO, auto_tokenizer, hf_ids, tokenizer_file

DATA = json.loads((REPO / "tests" / "faces" / "data" / "hf_compat_4_57.json").read_text())


def _folder(tmp_path, name, config):
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer.json").symlink_to(tokenizer_file("llama3_1"))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def _ids(handler, text):
    out = handler.execute({"QUERY": np.array([[text.encode()]], dtype=object),
                           "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)})
    return out["INPUT_ID"][0].tolist()


def test_reference_provenance():
    assert DATA["provenance"]["transformers"].startswith("4.57.") and DATA["provenance"]["tokenizer_json"] == "llama3_1"
    # the disagreement this module is about: 4.57 rebuilt the post-processor from the config's flags
    assert DATA["cases"]["bos0_eos1"]["ids"]["True"][0] == [15339, 1917, 128009]
    assert DATA["cases"]["bos0_eos0"]["ids"]["True"][0] == [15339, 1917]
    assert hf_ids("llama3_1", "hello world") == [128000, 15339, 1917]


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_preprocessing_matches_transformers_4_57(tmp_path, monkeypatch, case):
    """Engine ``hf``: the ids of the derived file itself (a fast engine would first compute guard tables for
    it; their admission is the engines' suite's subject)."""
    from toktier_backend.faces.trtllm import PreprocessingHandler

    monkeypatch.setenv("TOKTIER_CACHE_DIR", str(tmp_path / "cache"))
    ref = DATA["cases"][case]
    folder = _folder(tmp_path, case, ref["tokenizer_config"])
    for flag in (True, False):
        h = PreprocessingHandler.from_parameters({"tokenizer_dir": str(folder), "add_special_tokens": str(flag).lower(),
                                                  "engine": "hf"})
        assert h.base_vocab_size == ref["vocab_size"] and h.vocab_size == ref["len"]  # <unk> added, as 4.57
        for text, want in zip(DATA["texts"], ref["ids"][str(flag)]):
            assert _ids(h, text) == want, (case, flag, text)


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_hf_compat_5_matches_installed_transformers(tmp_path, case):
    """``hf_compat: 5`` serves the file as written, which is what transformers 5.x's AutoTokenizer returns."""
    import transformers

    from toktier_backend.faces.trtllm import PreprocessingHandler

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.fail(f"this test compares against transformers 5.x; {transformers.__version__} is installed")
    folder = _folder(tmp_path, case, DATA["cases"][case]["tokenizer_config"])
    tok = auto_tokenizer(str(folder), legacy=False, padding_side="left")
    h = PreprocessingHandler.from_parameters({"tokenizer_dir": str(folder), "hf_compat": "5", "engine": "hf"})
    for text in DATA["texts"]:
        assert _ids(h, text) == tok.encode(text) == hf_ids("llama3_1", text)


def test_hf_compat_rejects_unknown_version(tmp_path):
    from toktier_backend.faces.trtllm import PreprocessingHandler

    folder = _folder(tmp_path, "x", {"tokenizer_class": "LlamaTokenizerFast"})
    with pytest.raises(ValueError, match="hf_compat"):
        PreprocessingHandler.from_parameters({"tokenizer_dir": str(folder), "hf_compat": "4.99", "engine": "hf"})
