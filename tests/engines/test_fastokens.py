"""The fastokens engine (``toktier_backend.engines.fastokens``): its helper-thread setting, with ids equal to
the HF reference's. The protocol checks every engine shares are in ``test_protocol.py``."""

from __future__ import annotations

import os

from toktier_backend import corpus


def test_fastokens_helper_thread_is_off_unless_the_process_asks_and_exact_either_way(corpus_texts):
    """Importing the engine sets ``FASTOKENS_BPE_THREADS=1`` unless the process set it, so fastokens starts
    no helper thread and a long text's pieces run on the pool alone (``docs/design/parallel.md``); a value
    the process set is kept, fastokens' helper thread then runs, and a long text (chunked on the pool,
    pieces handed partly to that helper) still equals HF's ids. Each case in a fresh process: fastokens
    reads the variable once per process."""
    import subprocess
    import sys

    code = (
        "import os, sys, tokenizers, toktier_backend as tt\n"
        "text = open(sys.argv[1], encoding='utf-8').read()\n"
        "t = tt.load_tokenizer(engine='fastokens')\n"
        "assert t.chunked.wants(text), len(text)\n"
        "ids = t.encode(text, add_special_tokens=False).tolist()\n"
        "want = tokenizers.Tokenizer.from_file(str(tt.default_tokenizer_path()))"
        ".encode(text, add_special_tokens=False).ids\n"
        "names = [open(f'/proc/self/task/{x}/comm').read() for x in os.listdir('/proc/self/task')]\n"
        "print(os.environ['FASTOKENS_BPE_THREADS'], sum(n.startswith('fastokens') for n in names),"
        " ids == want, t.chunked.stats['chunks'] > 1)\n"
    )
    text = corpus.long_session_text(1_200_000)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"toktier-helper-{os.getpid()}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    try:
        for given, want in ((None, "1 0 True True"), ("2", "2 1 True True")):
            env = {k: v for k, v in os.environ.items() if k != "FASTOKENS_BPE_THREADS"}
            if given is not None:
                env["FASTOKENS_BPE_THREADS"] = given
            out = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True,
                                 timeout=300)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split("\n")[-2] == want, (given, out.stdout, out.stderr)
    finally:
        os.unlink(path)
