#!/usr/bin/env python3
"""Write a varied training prompt set for a chat target, most of it written by the target itself.

No downloads. Beside the task-template prompts of ``make_chat_prompts.py`` (training subjects only), the
target writes prompts at temperature > 0 from seed topics, several sequences per decode:

- questions and requests a user might send about a topic, some asking for long answers;
- programming tasks;
- sentences with mistakes, turned into rewriting prompts ("Fix the grammar: ...", "Make this formal: ...");
- multi-turn chats: a written question, the target's own greedy answer, then a follow-up request.

The held-out sets stay disjoint: ``make_chat_prompts.py``'s held-out subjects and this script's user-style
held-out prompts (``HELD_OUT_USER``, written here by hand in no template of the training set) are never seed
topics, and a written prompt that mentions one of their keywords is dropped. The output is a pure function of
the target, ``--seed`` and the counts (generation runs on the CPU with a fixed thread count).

    python scripts/make_varied_prompts.py --target SmolLM2.gguf --out-dir prompts --n-written 3000
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_chat_prompts  # noqa: E402  (the template prompts and their held-out subjects)

DOMAINS: dict[str, list[str]] = {
    "science": ["photosynthesis", "gravity", "black holes", "DNA", "the periodic table", "atoms", "light",
                "magnets", "earthquakes", "clouds", "the human heart", "bacteria", "energy", "friction",
                "chemical reactions", "the speed of sound", "fossils", "the solar wind", "genetics", "cells",
                "rainforests", "coral reefs", "deserts", "glaciers", "the ozone layer", "static electricity",
                "lenses", "the human eye", "muscles", "the brain", "nutrition", "vitamins", "sleep cycles"],
    "history": ["ancient Egypt", "the Roman Empire", "the Renaissance", "the Industrial Revolution",
                "the Vikings", "the Ming dynasty", "the Aztecs", "the American Revolution", "the Cold War",
                "the moon landing", "the invention of the telephone", "medieval castles", "the Olympic Games",
                "ancient Greece", "the Silk Road trade", "the history of money", "the first computers"],
    "technology": ["smartphones", "cloud computing", "electric cars", "solar panels", "3D printing",
                   "artificial intelligence", "the internet", "Wi-Fi", "GPS", "databases", "cybersecurity",
                   "passwords", "open source software", "robots", "drones", "virtual reality", "email",
                   "search engines", "computer memory", "operating systems", "web browsers", "spreadsheets"],
    "programming": ["Python lists", "Python dictionaries", "recursion", "sorting algorithms", "unit testing",
                    "regular expressions", "JSON files", "SQL queries", "git", "object-oriented programming",
                    "JavaScript promises", "HTML forms", "CSS layouts", "linked lists", "binary trees",
                    "string formatting", "error handling", "reading files", "command-line tools", "loops",
                    "functions", "classes", "big-O notation", "stacks and queues", "web APIs in Python"],
    "everyday life": ["cooking pasta", "making soup", "cleaning the kitchen", "doing laundry", "grocery shopping",
                      "saving money", "paying off debt", "renting an apartment", "moving house", "commuting",
                      "time management", "morning routines", "learning to swim", "riding a bike",
                      "caring for a dog", "keeping a cat happy", "growing herbs", "fixing a leaky tap",
                      "painting furniture", "sewing a button", "planning meals", "decluttering"],
    "health": ["running", "yoga", "stretching", "drinking water", "healthy snacks", "stress", "posture",
               "walking every day", "strength training", "healthy sleep", "eating vegetables", "breathing exercises"],
    "work": ["job interviews", "writing emails", "team meetings", "giving feedback", "asking for a raise",
             "working from home", "starting a small business", "marketing", "customer service",
             "public speaking", "leadership", "presentations", "project planning", "networking"],
    "arts": ["drawing", "photography", "writing poetry", "learning the piano", "jazz", "film making",
             "sculpture", "knitting", "pottery", "street art", "classical music", "dancing", "theater",
             "novels", "comic books", "graphic design"],
    "nature and animals": ["dolphins", "elephants", "owls", "wolves", "butterflies", "ants", "penguins",
                           "sharks", "horses", "parrots", "frogs", "spiders", "whales", "bears", "foxes",
                           "mushrooms", "oak trees", "wildflowers", "the Amazon river", "mountains", "oceans"],
    "places and travel": ["Japan", "Italy", "Brazil", "Egypt", "Canada", "India", "Australia", "Kenya",
                          "Paris", "New York", "London", "road trips", "backpacking", "train travel",
                          "packing a suitcase", "learning phrases before a trip", "national parks"],
    "society": ["voting", "recycling", "public libraries", "volunteering", "social media", "online privacy",
                "friendship", "family traditions", "holidays", "city parks", "public transport", "schools",
                "news", "advertising", "sports teams", "board games", "video games", "birthdays"],
    "math": ["fractions", "percentages", "prime numbers", "geometry", "algebra", "probability", "statistics",
             "the Pythagorean theorem", "multiplication tables", "negative numbers", "graphs", "averages"],
}

# meta-prompts the target answers at temperature > 0; {topic} is a seed topic. The kind names the family.
WRITERS: list[tuple[str, str]] = [
    ("question", "Write one question a curious person might ask about {topic}. Reply with the question only."),
    ("question", "Ask me an interesting question about {topic}. Reply with only the question."),
    ("request", "Write a request that someone could send to a helpful assistant about {topic}. "
                "Reply with the request only."),
    ("long", "Write a question about {topic} that needs a long, detailed answer. Reply with the question only."),
    ("howto", "Write a how-to question about {topic}, starting with 'How do I' or 'How can I'. "
              "Reply with the question only."),
]
CODE_WRITER = ("code", "Write a short programming exercise about {topic} for a beginner. Reply with the task only.")
REWRITE_WRITER = ("sentence", "Write one casual sentence about {topic}, the way someone texts a friend. "
                              "Reply with the sentence only.")
REWRITE_TASKS = ["Rewrite this sentence to be more formal: \"{}\"", "Fix the grammar and spelling: \"{}\"",
                 "Make this sound more friendly: \"{}\"", "Rewrite this as a polite email opening: \"{}\"",
                 "Turn this into a question: \"{}\"", "Rewrite this for a ten-year-old: \"{}\""]
FOLLOW_UPS = ["Can you give me an example?", "Can you explain that more simply?", "Can you make that shorter?",
              "What else should I know about this?", "Can you put that in a list?", "Why is that?",
              "Thanks! Can you summarize it in one sentence?", "Can you go into more detail on the first point?",
              "What are some common mistakes to avoid?", "Can you write that as a short poem?"]

# Held out from every training prompt: a user would write these, in no template of the training set.
HELD_OUT_USER = [
    ("I'm visiting Iceland in March. What should I pack?", ["iceland"]),
    ("Can you explain how a submarine dives and comes back up?", ["submarine"]),
    ("What's a good way to get started with watercolor painting?", ["watercolor"]),
    ("Write a Python function that checks whether a year is a leap year.", ["leap year"]),
    ("Explain what an API is to someone who doesn't program.", [" api", "api "]),
    ("Write a short poem about an abandoned train station.", ["train station"]),
    ("Rewrite this to sound more professional: hey, the invoice is late again, can u fix it", ["invoice"]),
    ("What are the pros and cons of electric scooters?", ["scooter"]),
    ("How do noise-cancelling headphones work?", ["headphone"]),
    ("Give me a three-day workout plan for a beginner.", ["workout plan"]),
    ("What is the difference between a violin and a viola?", ["violin", "viola"]),
    ("Write a short story about a clockmaker's daughter who finds a secret door.", ["clockmaker"]),
    ("Summarize the causes of World War I in a few sentences.", ["world war"]),
    ("Why do octopuses have three hearts?", ["octopus"]),
    ("Write a JavaScript function that debounces another function.", ["debounce"]),
    ("How can I politely decline a wedding invitation?", ["wedding"]),
]


def held_out_keywords() -> list[str]:
    """Lower-case words whose presence in a written prompt would leak a held-out subject into training."""
    words = [w for _, kws in HELD_OUT_USER for w in kws]
    for _templates, _train, held in make_chat_prompts.TASKS:
        words += [s.lower() for s in held]
    words += [s.lower() for s in make_chat_prompts.LIST_SUBJECTS[1] + make_chat_prompts.REWRITE_SENTENCES[1]]
    return words


def clean_written(text: str, min_chars: int = 12, max_chars: int = 400) -> str | None:
    """The first line of what the target wrote, without labels and quotes; None if unusable."""
    # the first line that is not an introduction ("Here is a question:")
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = next((ln for ln in lines if not ln.endswith(":")), "")
    for label in ("Question:", "Request:", "Task:", "Sentence:", "Exercise:", "Q:"):
        if line.lower().startswith(label.lower()):
            line = line[len(label):].strip()
    line = line.strip("\"'` *")
    if not min_chars <= len(line) <= max_chars or not any(c.isalpha() for c in line):
        return None
    return line


def leaks(text: str, keywords: list[str]) -> bool:
    low = f" {text.lower()} "
    return any(k in low for k in keywords)


def user(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def write_with_target(model, jobs: list[tuple[str, str]], *, seed: int, temperature: float, n_predict: int,
                      parallel: int, n_threads: int | None, greedy: bool = False) -> list[str]:
    """The target's replies to chat messages ``jobs`` (kind, text), ``parallel`` sequences per decode."""
    from pyllama_dspark import Context
    from pyllama_dspark.sampling import Sampler, SamplingParams
    from pyllama_dspark.train.data import continue_side_by_side

    prompts = [[int(t) for t in model.tokenize(model.apply_chat_template([{"role": "user", "content": text}]),
                                               parse_special=True)] for _kind, text in jobs]
    longest = max(len(p) for p in prompts) + n_predict + 1
    out: list[str] = []
    with Context(model, n_ctx=parallel * longest, n_batch=max(512, parallel), n_seq_max=parallel,
                 n_threads=n_threads) as ctx:
        for start in range(0, len(prompts), parallel):
            group = prompts[start:start + parallel]
            samplers = [Sampler(SamplingParams(temperature=0.0 if greedy else temperature, top_p=0.95,
                                               seed=seed * 1_000_003 + start + i)) for i in range(len(group))]
            for prompt, continued in zip(group, continue_side_by_side(ctx, group, samplers, n_predict)):
                tail = [t for t in continued.tokens[len(prompt):] if not model.is_eog(t)]
                out.append(model.detokenize(tail))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="the chat target GGUF that writes the prompts")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--n-written", type=int, default=3000, help="prompts the target writes (before dropping)")
    parser.add_argument("--n-multi-turn", type=int, default=600, help="written questions turned into 2-turn chats")
    parser.add_argument("--n-templates", type=int, default=0, help="template prompts kept (0 = all)")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from pyllama_dspark import Model

    rng = random.Random(args.seed)
    keywords = held_out_keywords()
    topics = [(domain, t) for domain, items in DOMAINS.items() for t in items if not leaks(t, keywords)]
    jobs: list[tuple[str, str]] = []
    for i in range(args.n_written):
        domain, topic = topics[rng.randrange(len(topics))]
        roll = rng.random()
        if domain == "programming" and roll < 0.5:
            kind, template = CODE_WRITER
        elif roll < 0.12:
            kind, template = REWRITE_WRITER
        else:
            kind, template = WRITERS[rng.randrange(len(WRITERS))]
        jobs.append((kind, template.format(topic=topic)))
    t0 = time.perf_counter()
    with Model(args.target) as model:
        written = write_with_target(model, jobs, seed=args.seed, temperature=args.temperature, n_predict=40,
                                    parallel=args.parallel, n_threads=args.n_threads)
        singles: list[dict] = []
        questions: list[str] = []
        seen: set[str] = set()
        dropped = 0
        for (kind, _meta), text in zip(jobs, written):
            line = clean_written(text)
            if line is None or line.lower() in seen or leaks(line, keywords):
                dropped += 1
                continue
            seen.add(line.lower())
            if kind == "sentence":
                singles.append(user(REWRITE_TASKS[rng.randrange(len(REWRITE_TASKS))].format(line)))
            else:
                singles.append(user(line))
                questions.append(line)
        rng.shuffle(questions)
        firsts = questions[: args.n_multi_turn]
        answers = write_with_target(model, [("answer", q) for q in firsts], seed=args.seed, temperature=0.0,
                                    n_predict=96, parallel=args.parallel, n_threads=args.n_threads, greedy=True)
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a.strip()},
                           {"role": "user", "content": FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))]}]}
             for q, a in zip(firsts, answers) if a.strip()]
    template_rng = random.Random(args.seed)
    templates = [text for family in make_chat_prompts.prompts_for(0) for text in family]
    template_rng.shuffle(templates)
    if args.n_templates:
        templates = templates[: args.n_templates]
    train = singles + chats + [user(t) for t in templates]
    rng.shuffle(train)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with (args.out_dir / "train.jsonl").open("w") as fh:
        for item in train:
            fh.write(json.dumps(item) + "\n")
    with (args.out_dir / "held_out_user.jsonl").open("w") as fh:
        for text, _kws in HELD_OUT_USER:
            fh.write(json.dumps(user(text)) + "\n")
    make_chat_prompts.main(["--out-dir", str(args.out_dir / "templates"), "--seed", str(args.seed)])
    print(f"{len(train)} training prompts ({len(singles)} written, {len(chats)} two-turn chats, {len(templates)} "
          f"from templates; {dropped} written ones dropped) and {len(HELD_OUT_USER)} user-style held-out prompts in "
          f"{args.out_dir} ({time.perf_counter() - t0:.0f} s); template held-out set: "
          f"{args.out_dir / 'templates' / 'held_out.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
