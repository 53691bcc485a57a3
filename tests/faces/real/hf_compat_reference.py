"""Write tests/faces/data/hf_compat_4_57.json: ids transformers' AutoTokenizer returns for the shared
llama3_1 tokenizer.json under tokenizer_config.json variants (LlamaTokenizerFast, add_bos_token /
add_eos_token). Run with the transformers under test in its own venv, e.g.

    python3 -m venv /tmp/tf457 && /tmp/tf457/bin/pip install -q transformers==4.57.1
    /tmp/tf457/bin/python tests/faces/real/hf_compat_reference.py ../shared/tokenizers/llama3_1/tokenizer.json \
        > tests/faces/data/hf_compat_4_57.json
"""

import json
import os
import sys
import tempfile

import tokenizers
import transformers
from transformers import AutoTokenizer

CONFIGS = {
    "bos0_eos1": {"add_bos_token": False, "add_eos_token": True},
    "bos0_eos0": {"add_bos_token": False, "add_eos_token": False},
    "bos1_eos1": {"add_bos_token": True, "add_eos_token": True},
    "unset": {},
}
TEXTS = ["hello world", "<unk> and <|eot_id|> inside", "", "  spaces\n\n", "naïve café 東京"]


def main(src: str) -> dict:
    out = {"provenance": {"command": " ".join(["python", *sys.argv]), "transformers": transformers.__version__,
                          "tokenizers": tokenizers.__version__, "tokenizer_json": os.path.basename(os.path.dirname(src))},
           "texts": TEXTS, "cases": {}}
    for name, flags in CONFIGS.items():
        d = tempfile.mkdtemp()
        os.symlink(os.path.abspath(src), os.path.join(d, "tokenizer.json"))
        cfg = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
               **flags}
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f)
        tok = AutoTokenizer.from_pretrained(d, legacy=False, padding_side="left")  # as TensorRT-LLM loads it
        out["cases"][name] = {
            "tokenizer_config": cfg,
            "ids": {str(flag): [tok.encode(t, add_special_tokens=flag) for t in TEXTS] for flag in (True, False)},
            "vocab_size": tok.vocab_size, "len": len(tok),
        }
    return out


if __name__ == "__main__":
    json.dump(main(sys.argv[1]), sys.stdout, indent=1)
    print()
