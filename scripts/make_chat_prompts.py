#!/usr/bin/env python3
"""Write the project's own chat prompt sets (training and held-out) as JSONL.

No downloads: every prompt is built here from task templates and subjects. The
held-out set uses subjects that never appear in the training set, so held-out
figures measure a drafter on topics it has not seen. The output is a pure
function of ``--seed`` and ``--n-train``.

    python scripts/make_chat_prompts.py --out-dir prompts --n-train 1500
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# (task templates, training subjects, held-out subjects)
TASKS: list[tuple[list[str], list[str], list[str]]] = [
    (["Explain {} in simple terms.", "Explain {} to a ten-year-old.", "Give a short definition of {}.",
      "Tell me three interesting facts about {}.", "Write a short paragraph about {}."], [
        "photosynthesis", "gravity", "inflation", "the water cycle", "machine learning",
        "black holes", "vaccines", "the stock market", "electricity", "DNA", "recursion",
        "the internet", "climate change", "supply and demand", "compound interest",
        "plate tectonics", "the immune system", "blockchain", "evolution", "sound waves",
        "the greenhouse effect", "a database index", "encryption", "rainbows", "tides",
        "the French Revolution", "democracy", "nuclear fusion", "antibiotics", "magnetism",
        "how a CPU works", "version control", "the theory of relativity", "sleep",
        "how airplanes fly", "the Roman Empire", "probability", "a neural network",
        "operating systems", "how batteries work", "cloud computing", "the moon phases",
    ], ["volcanoes", "hash tables", "the printing press", "how bees make honey"]),
    (["How do I {}?", "What are the steps to {}?", "I want to {}. Where should I start?"], [
        "bake bread at home", "learn to play the guitar", "start running", "save money each month",
        "write a good resume", "fix a flat bicycle tire", "grow tomatoes", "make a cup of tea",
        "prepare for a job interview", "learn a new language", "clean a laptop keyboard",
        "set up a Python virtual environment", "organize my closet", "improve my handwriting",
        "make friends in a new city", "plan a birthday party", "study for an exam",
        "reduce screen time", "care for a houseplant", "write a cover letter", "cook rice",
        "stay focused while working", "back up my phone", "change a light bulb",
        "train a puppy", "make pancakes", "use git branches", "meditate", "paint a room",
        "start a vegetable garden", "write unit tests", "budget for a vacation",
    ], ["tie a tie", "brew coffee with a French press", "read a map"]),
    (["Write a Python function that {}.", "Write a JavaScript function that {}.",
      "Show me Python code that {}, and explain it briefly."], [
        "reverses a string", "checks if a number is prime", "computes the factorial of n",
        "returns the Fibonacci numbers up to n", "counts the vowels in a string",
        "finds the largest element in a list", "removes duplicates from a list",
        "checks if a string is a palindrome", "sorts a list of dictionaries by a key",
        "merges two sorted lists", "converts Celsius to Fahrenheit", "flattens a nested list",
        "counts word frequencies in a text", "computes the average of a list",
        "finds the greatest common divisor of two numbers", "validates an email address",
        "reads a CSV file and prints each row", "returns the second smallest number in a list",
        "capitalizes every word in a sentence", "checks if two strings are anagrams",
        "computes the sum of digits of a number", "generates a random password",
        "implements binary search", "transposes a matrix", "rotates a list by k positions",
    ], ["converts a number to Roman numerals", "finds the longest word in a sentence"]),
    (["List {} {}."], [
        "five benefits of", "three tips for", "seven facts about", "four common mistakes in",
        "six ideas for", "five reasons to try",
    ], []),
    (["Write a short story about {}.", "Write the opening paragraph of a story about {}.",
      "Tell a bedtime story about {}."], [
        "a robot who learns to paint", "a lost cat finding its way home", "a girl who can talk to trees",
        "a dragon afraid of fire", "two friends on a road trip", "a detective in a small town",
        "a baker who makes magic bread", "an astronaut alone on Mars", "a boy and his kite",
        "a village that forgot how to laugh", "a clock that runs backwards", "a shy ghost",
        "a fisherman and a talking fish", "a library at midnight", "a knight who hates swords",
        "a penguin who wants to fly", "a wizard's apprentice", "a snowman in summer",
        "an old lighthouse keeper", "a time traveler stuck in 1900",
    ], ["a turtle that wins a race", "a musician who lost her voice"]),
    (["Rewrite this sentence to be {}: \"{}\""], [
        "more formal", "more polite", "simpler", "more exciting", "shorter", "more friendly",
    ], []),
    (["What is the difference between {}?", "Compare {} in a short table."], [
        "a virus and a bacterium", "weather and climate", "a list and a tuple in Python",
        "speed and velocity", "an alligator and a crocodile", "stocks and bonds",
        "RAM and storage", "a simile and a metaphor", "HTTP and HTTPS", "baking soda and baking powder",
        "a lake and a pond", "TCP and UDP", "mitosis and meiosis", "a comet and an asteroid",
        "empathy and sympathy", "a compiler and an interpreter", "latitude and longitude",
        "a democracy and a republic", "frogs and toads", "git merge and git rebase",
    ], ["a hurricane and a tornado", "a class and an object"]),
    (["Write a short poem about {}.", "Write a haiku about {}.", "Write a limerick about {}."], [
        "the ocean", "autumn leaves", "a rainy day", "friendship", "the city at night",
        "a cup of coffee", "mountains", "the first snow", "a sleeping cat", "the stars",
        "spring flowers", "an old book", "the morning sun", "a train journey", "the wind",
        "home", "a summer garden", "the desert", "childhood", "robots",
    ], ["a quiet forest", "the river"]),
    (["Give me some tips for {}.", "What should a beginner know about {}?"], [
        "sleeping better", "public speaking", "eating healthy on a budget", "learning to code",
        "staying productive at home", "taking better photos", "writing an essay",
        "keeping a journal", "traveling light", "running a marathon", "reading more books",
        "managing stress", "hosting a dinner party", "negotiating a salary", "drawing faces",
    ], ["camping in the rain", "learning chess"]),
    (["Why {}?", "Can you explain to a child why {}?"], [
        "is the sky blue", "do leaves change color in the fall", "do we dream",
        "do cats purr", "is the ocean salty", "do we have seasons", "do onions make us cry",
        "does ice float", "do birds migrate", "is exercise good for the brain",
        "do we yawn", "do stars twinkle", "does bread rise", "do people like pizza",
        "is sleep important", "do metals conduct electricity",
    ], ["do zebras have stripes", "does the moon look bigger near the horizon"]),
    (["Summarize the main ideas of {} in three sentences.", "What are the key points of {}?"], [
        "the industrial revolution", "object-oriented programming", "the scientific method",
        "stoicism", "the water cycle", "renewable energy", "the Renaissance", "minimalism",
        "the Cold War", "healthy eating", "agile software development", "the solar system",
    ], ["the Great Depression"]),
]

# "List {} {}." takes a count phrase and a subject: a separate subject pool.
LIST_SUBJECTS = (
    ["exercise", "reading", "learning to cook", "drinking water", "traveling", "gardening",
     "remote work", "meditation", "writing", "cycling", "music", "volunteering", "the ocean",
     "space", "Python", "healthy breakfasts", "saving energy", "studying", "team meetings"],
    ["keeping bees", "rock climbing"],
)
REWRITE_SENTENCES = (
    ["i cant come to the meeting tomorrow sorry", "the food was ok but the service was slow",
     "we need to finish this report by friday", "the movie was long and kind of boring",
     "please send me the files when you can", "our team won the game last night",
     "the new phone is fast and the camera is good", "it is raining so the picnic is cancelled",
     "the meeting got moved to next week", "thanks for helping me with the project"],
    ["the store closes early on sundays"],
)


def prompts_for(split: int) -> list[list[str]]:
    """Every prompt of one split (0 = training subjects, 1 = held-out subjects), by task family."""
    families: list[list[str]] = []
    for templates, *subjects in TASKS:
        out: list[str] = []
        for template in templates:
            if template.startswith("List"):
                for count_phrase in subjects[0]:
                    out.extend(template.format(count_phrase, subject) for subject in LIST_SUBJECTS[split])
            elif template.startswith("Rewrite"):
                for style in subjects[0]:
                    out.extend(template.format(style, sentence) for sentence in REWRITE_SENTENCES[split])
            else:
                out.extend(template.format(subject) for subject in subjects[split])
        families.append(out)
    return families


def round_robin(families: list[list[str]], rng: random.Random) -> list[str]:
    """Interleave the shuffled families so any prefix covers every kind of task."""
    for family in families:
        rng.shuffle(family)
    out: list[str] = []
    for i in range(max(map(len, families))):
        out.extend(family[i] for family in families if i < len(family))
    return out


def write_jsonl(path: Path, prompts: list[str]) -> None:
    with path.open("w") as fh:
        for text in prompts:
            fh.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--n-train", type=int, default=0, help="0 = all training prompts")
    parser.add_argument("--n-held-out", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    train = [text for family in prompts_for(0) for text in family]
    rng.shuffle(train)
    held_out = round_robin(prompts_for(1), rng)
    if args.n_train:
        train = train[: args.n_train]
    held_out = held_out[: args.n_held_out]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "held_out.jsonl", held_out)
    print(f"{len(train)} training and {len(held_out)} held-out prompts in {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
