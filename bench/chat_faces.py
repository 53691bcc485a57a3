"""Per-turn cost of a chat request through the serving core, as a face makes it, against the faces' previous
path, in one run.

Conversations and turns as ``bench/chat.py`` builds them (SWE-agent corpus; ``--samples`` turns of 2 new
messages, ``add_generation_prompt=True``, ``tools`` for the tool templates). Systems, each on every sample in
turn, one core per system (no verifier: replies are not sampled), keyed by one conversation ID:

- ``core.chat(bytes)``: ``ServingCore.chat(origin, messages_json_bytes, key=...)``, as Triton's
  ``MESSAGES`` reaches the core: the bytes are parsed from the first changed message on
  (``chat.wire.IncrementalBody``), rendered incrementally, the tokenizer session advanced from the
  departure; ``reply="patch"`` (what ``toktier_session`` clients ask for);
- ``core.chat(dicts)``: the same with the messages decoded by orjson (untimed), as the proxy, vLLM and
  Dynamo faces pass them (every message compared with the previous request's);
- ``render+encode``: what the faces did before: jinja2 full render (``chat.template.ChatRenderer``), then
  ``ServingCore.encode(text, key=...)`` in the keyed session.

Exactness: every sample's ids (full ids: the reply's ``keep`` prefix from the previous reply) are compared
with gigatoken's encode of the jinja2 render, and the first and last samples' with HF ``tokenizers``.

Usage:
    python bench/chat_faces.py --templates qwen3,llama3_1 --sizes 100000,1000000 --samples 24
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchors as A  # noqa: E402
import chat as B  # noqa: E402  (bench/chat.py: conversations and request bodies)

A.ensure_repo_on_path()

SYSTEMS = ("core.chat(bytes)", "core.chat(dicts)", "render+encode")


def _folder(shared: Path, name: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"chat_faces_{name}_"))
    (d / "tokenizer.json").symlink_to(shared / "tokenizers" / name / "tokenizer.json")
    (d / "tokenizer_config.json").symlink_to(shared / "chat_templates" / name / "tokenizer_config.json")
    return d


def run(name: str, size: int, samples: int, shared: Path) -> dict:
    import gigatoken
    import orjson
    import tokenizers

    import toktier_backend as tt
    from toktier_backend.chat.template import ChatRenderer, load_chat_template, special_tokens
    from toktier_backend.serving.core import ServingCore
    from toktier_backend.serving.metrics import Origin

    path = _folder(shared, name) / "tokenizer.json"
    src, sp = load_chat_template(path), special_tokens(path)
    tok = tt.load_tokenizer(str(path))
    ref = tokenizers.Tokenizer.from_file(str(path))
    giga = gigatoken.Tokenizer(str(path))
    renderer = ChatRenderer(src, sp)
    conv, start = B.conversation(name, size, samples)
    bodies = [orjson.dumps(conv[:start + 2 * (s + 1)]) for s in range(samples)]  # MESSAGES: the array
    options = {"tools": B.TOOLS} if name in B.C.TOOL_TEMPLATES else {}
    origin = Origin("bench", "chat")
    out = {}
    for system in SYSTEMS:
        core = ServingCore(tok, chat_template=src, special_tokens=sp)
        warm = orjson.dumps(conv[:start])
        if system == "render+encode":
            r = core.encode(origin, renderer.render(orjson.loads(warm), add_generation_prompt=True, **options),
                            key="conv", add_special_tokens=False)
        else:
            r = core.chat(origin, warm if system == "core.chat(bytes)" else orjson.loads(warm), key="conv",
                          add_generation_prompt=True, reply="full", **options)
        ms, bad, checked = [], 0, 0
        held = r.ids.tolist()  # the full ids the next patch reply's keep refers to
        for i, raw in enumerate(bodies):
            arg = bytes(raw) if system == "core.chat(bytes)" else orjson.loads(raw)
            gc.collect()
            t0 = time.perf_counter()
            if system == "render+encode":
                r = core.encode(origin, renderer.render(arg, add_generation_prompt=True, **options), key="conv",
                                add_special_tokens=False)
            else:
                r = core.chat(origin, arg, key="conv", add_generation_prompt=True, reply="patch", **options)
            ms.append((time.perf_counter() - t0) * 1e3)
            ids = r.ids.tolist()
            if len(ids) < r.n:  # a patch reply: ids from keep on
                ids = held[:r.keep] + ids
            held = ids
            text = renderer.render(orjson.loads(raw), add_generation_prompt=True, **options)
            want = (ref.encode(text, add_special_tokens=False).ids if i in (0, samples - 1)
                    else np.asarray(giga.encode(text)).tolist())
            checked += 1
            bad += ids != want
        core.close()
        out[system] = {"n": len(ms), "p50": A.percentile(ms, 50), "p90": A.percentile(ms, 90), "checked": checked,
                       "mismatches": bad}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--templates", default="qwen3,llama3_1")
    p.add_argument("--sizes", default="100000,1000000")
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--shared", default=None, help="the shared folder (default ../shared)")
    args = p.parse_args(argv)
    shared = A.shared_dir(args.shared)
    print(f"{'template':<10} {'chars':>8} {'system':<18} {'n':>3} {'p50 ms':>8} {'p90 ms':>8} {'x bytes p50':>11}  exact")
    for name in args.templates.split(","):
        for size in map(int, args.sizes.split(",")):
            r = run(name, size, args.samples, shared)
            base = r["core.chat(bytes)"]["p50"]
            for system in SYSTEMS:
                s = r[system]
                exact = "yes" if s["mismatches"] == 0 else f"NO ({s['mismatches']}/{s['checked']})"
                print(f"{name:<10} {size // 1000:>7}K {system:<18} {s['n']:>3} {s['p50']:>8.2f} {s['p90']:>8.2f} "
                      f"{s['p50'] / base:>10.1f}x  {exact}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
