#!/usr/bin/env python3
"""Write the task-category prompt set of scripts/bench_tasks.py: benchmarks/tasks/tasks.jsonl.

Seven categories of 8 chat prompts each, built without downloads: written prompts (multi-turn chat, translation,
QA, math word problems), and texts that ship with installed packages under licenses that allow it (numpy's
docstrings, BSD-3-Clause; CPython's standard library docstrings and source, PSF License): summarization of a long
document (1-3k tokens), retrieval-augmented QA over several passages, and code editing (a function returned with
one change). Each line: {"category", "id", "messages", "source"}. The texts come from the numpy and Python this
script runs on, so rerunning it elsewhere may change them: the committed file is the set.

Usage: make_task_prompts.py [--out benchmarks/tasks/tasks.jsonl]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "tasks" / "tasks.jsonl"

CHAT = [
    [("user", "I'm planning a week in Portugal in May. Lisbon or Porto as a base?"),
     ("assistant", "Both work well in May. Lisbon has more day trips (Sintra, Cascais) and a bigger food scene; "
                   "Porto is smaller, cheaper and close to the Douro valley wineries."),
     ("user", "I like wine and I don't want to move around much. Which one, and what would you do each day?")],
    [("user", "My sourdough comes out flat. What could be wrong?"),
     ("assistant", "The usual causes are a weak starter, over-proofing, or too little tension when shaping."),
     ("user", "The starter doubles in about 4 hours. How do I tell if I'm over-proofing?")],
    [("user", "Can you explain what a hash table is?"),
     ("assistant", "A hash table stores key-value pairs in an array; a hash function turns each key into an "
                   "index, so lookups take constant time on average."),
     ("user", "What happens when two keys get the same index?")],
    [("user", "I want to start running. I'm 40 and haven't exercised in years."),
     ("assistant", "Start with walk-run intervals three times a week, for example one minute running and two "
                   "minutes walking, for 20-30 minutes."),
     ("user", "How long until I can run 5 km without stopping?")],
    [("user", "What's the difference between weather and climate?"),
     ("assistant", "Weather is the state of the atmosphere at a given time and place; climate is the average of "
                   "weather over decades."),
     ("user", "So how can scientists predict the climate 50 years ahead when they can't predict rain next week?")],
    [("user", "Write a haiku about autumn."),
     ("assistant", "Crimson leaves descend\nwhispering to the cold ground\nthe year exhales slow"),
     ("user", "Nice. Now one about winter, in the same style.")],
    [("user", "I need to email my landlord about a broken heater. Can you help?"),
     ("assistant", "Of course. Tell me when it broke, what you have tried, and what you would like them to do."),
     ("user", "It stopped working on Monday, I reset the breaker, and I'd like it fixed this week. "
              "Please write the email.")],
    [("user", "Why do cats purr?"),
     ("assistant", "Cats purr when content, but also when stressed or injured; the vibration may help them "
                   "calm down and even heal."),
     ("user", "Do big cats like lions purr too?")],
]

TRANSLATION = [
    ("French", "The library opens at nine in the morning and closes at six in the evening, except on Sundays."),
    ("Spanish", "Please remember to water the plants while I am away, and leave the key under the mat."),
    ("German", "The train to Berlin was delayed by forty minutes because of a technical problem."),
    ("French", "Our team finished the project two weeks early, and the client was very happy with the result."),
    ("Italian", "I would like to book a table for four people tomorrow evening at eight o'clock."),
    ("Spanish", "The museum has a large collection of paintings from the nineteenth century."),
    ("German", "If it rains tomorrow, we will stay at home and watch a film instead of going to the beach."),
    ("French", "Drinking enough water every day is important for your health, especially in summer."),
]

QA = [
    "What is the capital of Australia, and why was it chosen over Sydney and Melbourne?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "Who wrote 'Pride and Prejudice', and what is it about?",
    "What is the difference between a virus and a bacterium?",
    "Why is the ocean salty?",
    "What does a CPU cache do?",
    "How do vaccines train the immune system?",
]

MATH = [
    "A bakery sells muffins for $3 each and cookies for $1.50 each. Maria buys 4 muffins and 6 cookies. "
    "How much does she pay? Explain step by step.",
    "A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is its average speed over the whole "
    "trip? Show your work.",
    "Tom has twice as many marbles as Sara. Together they have 36 marbles. How many does each have? "
    "Solve step by step.",
    "A rectangle is 3 times as long as it is wide, and its perimeter is 48 cm. What is its area? Explain.",
    "A shirt costs $40. It is discounted by 25 %, and then a 10 % tax is added to the discounted price. "
    "What is the final price? Show each step.",
    "A tank holds 500 liters. It is filled at 20 liters per minute while it drains at 5 liters per minute. "
    "Starting empty, how long until it is full? Explain.",
    "There are 5 red, 3 blue and 2 green balls in a bag. What is the probability of drawing a blue ball? "
    "Then of drawing two blue balls in a row without replacement? Explain.",
    "A farmer has chickens and cows, 30 animals and 74 legs in total. How many chickens and how many cows? "
    "Solve step by step.",
]

# long documents to summarize: numpy docstrings (BSD-3-Clause) and CPython's `re` module docstring (PSF)
SUMMARIZE = ["numpy.quantile", "numpy.pad", "numpy.fft", "numpy.gradient", "numpy.memmap", "numpy.polyfit",
             "numpy.lib.format", "re"]

# retrieval-augmented QA: (passages, question); each passage a numpy docstring, the answer in one of them
RAG = [
    (["numpy.clip", "numpy.argsort", "numpy.cumsum", "numpy.where"],
     "According to the passages, what does clip do with values outside the interval, and what are its "
     "arguments?"),
    (["numpy.linspace", "numpy.arange", "numpy.logspace", "numpy.geomspace"],
     "According to the passages, when should linspace be preferred over arange, and why?"),
    (["numpy.concatenate", "numpy.stack", "numpy.vstack", "numpy.split"],
     "Based on the passages, what is the difference between concatenate and stack?"),
    (["numpy.mean", "numpy.median", "numpy.average", "numpy.nanmean"],
     "Based on the passages, how does average differ from mean, and what does its weights argument do?"),
    (["numpy.reshape", "numpy.ravel", "numpy.transpose", "numpy.squeeze"],
     "According to the passages, what does squeeze do, and what happens if you pass an axis whose length "
     "is not one?"),
    (["numpy.unique", "numpy.searchsorted", "numpy.sort", "numpy.argmax"],
     "Using the passages, explain what searchsorted returns and what its side argument changes."),
    (["numpy.dot", "numpy.matmul", "numpy.outer", "numpy.inner"],
     "According to the passages, how does matmul differ from dot for arrays with more than two dimensions?"),
    (["numpy.isclose", "numpy.allclose", "numpy.array_equal", "numpy.any"],
     "Based on the passages, what formula does isclose use to compare two values?"),
]

# code editing: CPython standard library functions (PSF License), each returned with one change
CODE = [
    ("textwrap.dedent", "Rename the local variable `margin` to `common_prefix`."),
    ("heapq.nlargest", "Rename the parameter `iterable` to `items` everywhere."),
    ("statistics.median", "Add a docstring line saying that the data must not be empty."),
    ("textwrap.indent", "Change the default of `predicate` handling so that whitespace-only lines are indented "
                        "too (keep everything else)."),
    ("difflib.get_close_matches", "Change the default value of `cutoff` from 0.6 to 0.7."),
    ("statistics.mode", "Rename the function to `most_common_value`."),
    ("fnmatch.fnmatch", "Rename the parameter `pat` to `pattern` everywhere."),
    ("statistics.geometric_mean", "Rename the function to `geo_mean` and keep the rest unchanged."),
]


def _resolve(dotted: str):
    module, _, attr = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(module), attr)


def _doc(dotted: str) -> str:
    return inspect.cleandoc(_resolve(dotted).__doc__)


def _passage(dotted: str, limit: int = 2200) -> str:
    """A docstring cut at its last paragraph break before ``limit`` characters (a passage, not the whole page)."""
    doc = _doc(dotted)
    if len(doc) <= limit:
        return doc
    cut = doc.rfind("\n\n", 0, limit)
    return doc[:cut if cut > 0 else limit]


def build() -> list[dict]:
    rows = []

    def add(category: str, i: int, messages: list[dict], source: str) -> None:
        rows.append({"category": category, "id": f"{category}-{i}", "messages": messages, "source": source})

    for i, turns in enumerate(CHAT):
        add("chat", i, [{"role": role, "content": text} for role, text in turns], "written")
    for i, (language, sentence) in enumerate(TRANSLATION):
        add("translation", i, [{"role": "user", "content": f"Translate into {language}:\n\n{sentence}"}], "written")
    for i, name in enumerate(SUMMARIZE):
        text = f"Summarize the following documentation in a few sentences.\n\n{_doc(name)}"
        add("summarization", i, [{"role": "user", "content": text}],
            f"{name} docstring ({'numpy, BSD-3-Clause' if name.startswith('numpy') else 'CPython, PSF License'})")
    for i, question in enumerate(QA):
        add("qa", i, [{"role": "user", "content": question}], "written")
    for i, problem in enumerate(MATH):
        add("math", i, [{"role": "user", "content": problem}], "written")
    for i, (names, question) in enumerate(RAG):
        passages = "\n\n".join(f"Passage {j + 1} ({name}):\n{_passage(name)}" for j, name in enumerate(names))
        add("rag", i, [{"role": "user", "content": f"{passages}\n\nQuestion: {question}"}],
            f"docstrings of {', '.join(names)} (numpy, BSD-3-Clause)")
    for i, (name, change) in enumerate(CODE):
        source = inspect.getsource(_resolve(name))
        text = (f"Here is a Python function:\n\n```python\n{source}```\n\n{change} Return the whole function with "
                "this one change, and nothing else.")
        add("code_edit", i, [{"role": "user", "content": text}], f"CPython {name} source (PSF License)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = build()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    import numpy
    print(f"make_task_prompts: {len(rows)} prompts to {args.out} (numpy {numpy.__version__}, Python "
          f"{sys.version.split()[0]})", file=sys.stderr)


if __name__ == "__main__":
    main()
