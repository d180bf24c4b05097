#!/usr/bin/env python3
"""Write a training prompt set for a base (non-chat) target: text beginnings the target continues.

No downloads, no generation: every prompt is a beginning, and ``pyllama-dspark train`` has the target write the
rest (its greedy continuations are the training data). Five kinds, interleaved so any prefix has all of them:

- ``doc``: the first 150-1,500 characters (cut at a line end) of a docstring of a CPython standard-library module,
  class or function (PSF License);
- ``code``: the first lines of a pure-Python function's or class's source from the same modules;
- ``transcript``: ``make_chat_prompts.py``'s training prompts as a plain transcript, "User: ...\\nAssistant:" (how
  ``scripts/bench_tasks.py`` renders its chats for a target without a chat template);
- ``opening``: an article, essay, list or Q&A beginning about a seed topic of ``make_varied_prompts.py``;
- ``math``: a word problem with its numbers drawn here, then "Answer: Let's think step by step.".

The benchmark's texts stay out: no numpy, and none of the standard-library modules ``make_task_prompts.py``
reads (``HELD_OUT_MODULES``); held-out chat subjects are never used. ``held_out.jsonl`` holds 16 transcripts of
``make_chat_prompts.py``'s held-out prompts (subjects never in training) for ``train --eval-prompts``. The output
is a pure function of ``--seed``, the counts and the Python it runs on (the docstrings are this Python's).

    python scripts/make_base_prompts.py --out-dir prompts-base --n 2000
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_chat_prompts  # noqa: E402  (templated chat prompts and their held-out subjects)
import make_varied_prompts  # noqa: E402  (seed topics)

MODULES = ["argparse", "json", "collections", "pathlib", "functools", "itertools", "contextlib", "dataclasses",
           "enum", "typing", "string", "datetime", "calendar", "csv", "configparser", "logging", "shutil",
           "tempfile", "glob", "os", "subprocess", "threading", "queue", "sched", "socket", "selectors", "ssl",
           "email.message", "email.utils", "http.client", "http.server", "urllib.parse", "urllib.request",
           "html", "html.parser", "xml.dom.minidom", "xml.etree.ElementTree", "sqlite3", "zipfile", "tarfile",
           "gzip", "bz2", "lzma", "hashlib", "hmac", "secrets", "random", "fractions", "decimal", "numbers",
           "math", "cmath", "operator", "copy", "pprint", "reprlib", "abc", "io", "codecs", "unicodedata",
           "locale", "gettext", "base64", "binascii", "struct", "array", "bisect", "weakref", "types",
           "inspect", "dis", "ast", "tokenize", "traceback", "warnings", "unittest", "doctest", "pdb", "timeit",
           "trace", "asyncio", "concurrent.futures", "multiprocessing", "platform", "sysconfig", "shlex",
           "optparse", "getopt", "uuid", "ipaddress", "mimetypes", "mailbox", "smtplib", "imaplib", "ftplib",
           "poplib", "wave", "colorsys", "turtle", "cmd", "code", "codeop", "pkgutil", "importlib", "runpy",
           "zipimport", "compileall", "py_compile", "filecmp", "fileinput", "stat", "linecache", "netrc",
           "plistlib", "quopri", "graphlib", "contextvars", "tomllib", "zoneinfo", "pickle", "shelve", "dbm"]
# what scripts/make_task_prompts.py reads for the benchmark (numpy is never imported here)
HELD_OUT_MODULES = {"re", "textwrap", "heapq", "statistics", "difflib", "fnmatch"}

OPENINGS = ["{T} is", "Here is a short article about {t}.\n\n", "# {T}\n\n", "A beginner's guide to {t}\n\n",
            "Five things everyone should know about {t}:\n\n1.", "Q: What is the most important fact about {t}?\nA:",
            "My notes on {t}\n\n- ", "Why does {t} matter? ", "The history of {t} begins",
            "Frequently asked questions about {t}\n\nQ:", "An essay on {t}\n\nIntroduction\n\n",
            "Lesson plan: {t}\n\nObjective:"]
MATH = [("A shop sells {a} apples in the morning and {b} in the afternoon. Each apple costs {c} cents. "
         "How many cents does the shop earn?"),
        "Tom has {a} marbles. He gives {b} to his sister and buys {c} more. How many marbles does he have now?",
        "A train travels {a} km in {b} hours. At the same speed, how far does it travel in {c} hours?",
        "A class has {a} students. {b} of them walk to school and the rest take the bus in groups of {c}. "
        "How many groups take the bus?",
        "A rectangle is {a} cm long and {b} cm wide. A second one is {c} cm longer. What is the second's area?",
        "Sara saves {a} dollars a week for {b} weeks and then spends {c} dollars. How much does she have left?"]


def _allowed(name: str) -> bool:
    return name.split(".")[0] not in HELD_OUT_MODULES and not name.startswith("numpy")


def _prefix(text: str, rng: random.Random, lo: int, hi: int) -> str | None:
    """A beginning of ``text`` of lo..hi characters, cut after a line end (None if the text is shorter)."""
    if len(text) < lo:
        return None
    cut = text.rfind("\n", 0, rng.randint(lo, hi))
    return text[: cut + 1] if cut >= lo // 2 else text[: rng.randint(lo, hi)]


def library_texts() -> tuple[list[str], list[str]]:
    """(docstrings, sources) of the allowed modules' public members, in a fixed order."""
    docs, sources = [], []
    for name in MODULES:
        if not _allowed(name):
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 (a module this Python lacks or cannot import here)
            continue
        if (module.__doc__ or "").strip():
            docs.append(inspect.cleandoc(module.__doc__))
        for attr in sorted(vars(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 200:
                docs.append(f"{attr}\n\n{doc}")
            try:
                source = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if 200 <= len(source):
                sources.append(source)
    return docs, sources


def transcript(question: str) -> str:
    return f"User: {question}\nAssistant:"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--n", type=int, default=2000, help="training prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    docs, sources = library_texts()
    rng.shuffle(docs)
    rng.shuffle(sources)
    kinds: dict[str, list[str]] = {
        "doc": [p for p in (_prefix(d, rng, 150, 1500) for d in docs) if p],
        "code": [p for p in (_prefix(s, rng, 120, 900) for s in sources) if p],
        "transcript": [transcript(t) for family in make_chat_prompts.prompts_for(0) for t in family],
        "opening": [],
        "math": [],
    }
    rng.shuffle(kinds["transcript"])
    topics = [t for ts in make_varied_prompts.DOMAINS.values() for t in ts]
    held = make_varied_prompts.held_out_keywords()
    topics = [t for t in topics if not make_varied_prompts.leaks(t, held)]
    for topic in topics:
        for template in rng.sample(OPENINGS, 3):
            kinds["opening"].append(template.format(t=topic, T=topic[0].upper() + topic[1:]))
    rng.shuffle(kinds["opening"])
    for _ in range(args.n // 5 + 1):
        problem = rng.choice(MATH).format(a=rng.randint(3, 60), b=rng.randint(2, 12), c=rng.randint(2, 9))
        kinds["math"].append(f"Question: {problem}\nAnswer: Let's think step by step.")

    order = list(kinds)
    out: list[tuple[str, str]] = []
    i = 0
    while len(out) < args.n and any(i < len(kinds[k]) for k in order):
        out.extend((k, kinds[k][i]) for k in order if i < len(kinds[k]))
        i += 1
    out = out[: args.n]
    held_out = [transcript(t) for t in make_chat_prompts.round_robin(make_chat_prompts.prompts_for(1), rng)[:16]]

    args.out_dir.mkdir(parents=True, exist_ok=True)
    with (args.out_dir / "train.jsonl").open("w") as fh:
        for kind, text in out:
            fh.write(json.dumps({"prompt": text, "kind": kind}) + "\n")
    with (args.out_dir / "held_out.jsonl").open("w") as fh:
        for text in held_out:
            fh.write(json.dumps({"prompt": text}) + "\n")
    counts = {k: sum(1 for kind, _ in out if kind == k) for k in order}
    print(f"{len(out)} training prompts ({', '.join(f'{k} {n}' for k, n in counts.items())}) and {len(held_out)} "
          f"held-out transcripts in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
