"""Per-turn cost of a chat request through the serving core: ``ServingCore.chat`` (keyed; incremental render in
the conversation's session) vs the faces' previous path (jinja2 ``ChatRenderer`` full render, then
``ServingCore.encode`` in the keyed session). Messages decoded from JSON each turn (orjson), conversations built
as ``bench/chat.py`` builds them. Ids asserted equal to HF ``tokenizers`` on the first and last turn.

    python bench/chat_faces.py qwen3,llama3_1 100000,1000000
"""
import sys, time
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO)); sys.path.insert(0, str(REPO / "bench"))
SHARED = REPO.parent / "shared"
import orjson, tokenizers
import toktier_backend as tt
from chat import conversation, requests
from toktier_backend.chat.template import ChatRenderer, load_chat_template, special_tokens
from toktier_backend.serving.core import ServingCore
from toktier_backend.serving.metrics import Origin
import tempfile

O = Origin("proxy", "chat")
for name in sys.argv[1].split(","):
    for size in map(int, sys.argv[2].split(",")):
        d = Path(tempfile.mkdtemp())
        (d / "tokenizer.json").symlink_to(SHARED / "tokenizers" / name / "tokenizer.json")
        (d / "tokenizer_config.json").symlink_to(SHARED / "chat_templates" / name / "tokenizer_config.json")
        path = d / "tokenizer.json"
        src, sp = load_chat_template(path), special_tokens(path)
        tok = tt.load_tokenizer(str(path))
        ref = tokenizers.Tokenizer.from_file(str(path))
        samples = 24
        conv, start = conversation(name, size, samples)
        reqs = requests(conv, start, samples, False)
        res = {}
        for mode in ("core.chat", "render+encode"):
            core = ServingCore(tok, chat_template=src, special_tokens=sp, session_budget_bytes=0)
            renderer = ChatRenderer(src, sp)
            warm = orjson.loads(orjson.dumps(conv[:start - 2]))
            if mode == "core.chat":
                core.chat(O, warm, key="k", add_generation_prompt=True)
            else:
                core.encode(O, renderer.render(warm, add_generation_prompt=True), key="k", add_special_tokens=False)
            ts = []
            for i, m in enumerate(reqs):
                t0 = time.perf_counter()
                if mode == "core.chat":
                    r = core.chat(O, m, key="k", add_generation_prompt=True)
                else:
                    r = core.encode(O, renderer.render(m, add_generation_prompt=True), key="k", add_special_tokens=False)
                ts.append((time.perf_counter() - t0) * 1e3)
                if i in (0, samples - 1):
                    assert r.ids.tolist() == ref.encode(renderer.render(m, add_generation_prompt=True), add_special_tokens=False).ids
            ts.sort()
            res[mode] = (ts[len(ts) // 2], ts[int(len(ts) * 0.9)])
            core.close()
        a, b = res["core.chat"], res["render+encode"]
        print(f"{name} {size//1000}K chars n={samples}: core.chat p50/p90 {a[0]:.2f}/{a[1]:.2f} ms; render+encode {b[0]:.2f}/{b[1]:.2f} ms; ratio p50 {b[0]/a[0]:.1f}x", flush=True)
