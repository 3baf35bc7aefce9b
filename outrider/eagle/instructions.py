"""Instructions to train a draft head on: task templates × topics ×
styles, every word written for this project (licence: the project's own,
Apache-2.0, as pyproject.toml declares), none taken from a benchmark.

:func:`instructions` gives the same list for the same seed, and the first
N of a longer list are the list of N: a larger run reuses what a smaller
one generated.
"""

from __future__ import annotations

import random

LICENSE = "Apache-2.0 (written for Outrider: the project's own licence, pyproject.toml)"

TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the human heart",
    "bees and pollination", "the printing press", "electric cars", "compound interest",
    "recycling plastic", "the Roman Empire", "coral reefs", "vaccines", "solar panels",
    "the internet", "rainbows", "earthquakes", "the moon's phases", "coffee", "chess",
    "bread baking", "bicycles", "sleep", "migrating birds", "glaciers", "the stock market",
    "public libraries", "honey", "wind turbines", "tides", "dinosaurs", "the immune system",
    "music theory", "gardening in small spaces", "time zones", "the metric system",
    "penguins", "rain forests", "batteries", "airplanes and lift", "friendship",
    "learning a new language", "remote work", "saving money", "healthy breakfasts",
    "city parks", "trains", "the Olympic Games", "deserts", "octopuses", "maps",
    "clouds", "magnets", "the alphabet", "tea", "lighthouses", "robots", "origami",
    "climate change", "fossils", "the periodic table", "mountains", "rivers", "museums",
    "video games", "recipes with rice", "first aid", "running a marathon", "kites",
    "space stations", "lakes", "hot air balloons", "the seasons", "bridges", "elephants",
)  # fmt: skip

AUDIENCES = (
    "a ten-year-old", "a busy manager", "a first-year student", "my grandmother",
    "a curious engineer", "a new employee", "a tourist", "a beginner",
)  # fmt: skip

STYLES = (
    "in simple words", "in three short paragraphs", "in under 100 words", "with an example",
    "as a numbered list", "in a friendly tone", "in a formal tone", "with one analogy",
)  # fmt: skip

TOPIC_TASKS = (
    "Explain {topic} to {audience} {style}.",
    "What is {topic}? Answer {style}.",
    "Write a short story about {topic}.",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Give me five interesting facts about {topic}.",
    "List the pros and cons of {topic}.",
    "Summarise what everyone should know about {topic} {style}.",
    "Write a short email to {audience} inviting them to a talk about {topic}.",
    "Write a blog post introduction about {topic}.",
    "Compare {topic} and {other}. How are they alike and how do they differ?",
    "Give step-by-step instructions for learning about {topic}.",
    "Write three quiz questions about {topic}, with answers.",
    "Describe a day in the life of someone who works with {topic}.",
    "Why does {topic} matter? Explain {style}.",
    "Write a product description for a toy inspired by {topic}.",
    "What are common misconceptions about {topic}?",
    "Write a dialogue between two friends talking about {topic}.",
    "Write a tweet about {topic}.",
    "Suggest a weekend project related to {topic}.",
)  # fmt: skip

HOWTOS = (
    "make a cup of tea", "plant a tree", "write a cover letter", "prepare for an exam",
    "organise a small party", "learn to ride a bicycle", "clean a laptop keyboard",
    "start a vegetable garden", "plan a budget for a month", "change a flat tyre",
    "write a good summary", "make pancakes", "fold a paper airplane", "back up a phone",
    "prepare for a job interview", "care for a houseplant", "pack for a weekend trip",
    "make a simple website", "stay focused while studying", "cook pasta",
)  # fmt: skip

NAMES = ("Ana", "Ben", "Chloe", "David", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas")
ITEMS = ("apples", "books", "pencils", "cookies", "stickers", "marbles", "tickets", "eggs")

CODE_TASKS = (
    "returns the sum of a list of numbers",
    "checks whether a string is a palindrome",
    "counts the vowels in a string",
    "returns the largest of three numbers",
    "reverses the words of a sentence",
    "returns the n-th Fibonacci number",
    "removes duplicates from a list while keeping the order",
    "converts a temperature from Celsius to Fahrenheit",
    "checks whether a number is prime",
    "returns the average of a list, or 0 for an empty list",
    "counts how often each word appears in a text",
    "merges two sorted lists into one sorted list",
    "returns the factorial of n",
    "capitalises the first letter of every word",
    "finds the second smallest number in a list",
    "flattens a list of lists",
)  # fmt: skip

SENTENCES = (
    "The weather is nice today.", "Where is the train station?", "I would like a coffee, please.",
    "My brother plays the guitar.", "We are going to the beach tomorrow.",
    "This book is very interesting.", "Can you help me, please?", "The shop opens at nine.",
    "I have lived here for five years.", "The children are playing in the park.",
)  # fmt: skip
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")

FACTS = (
    "What is the capital of {country}?", "What language is spoken in {country}?",
    "Tell me about the geography of {country}.", "What food is {country} known for?",
)  # fmt: skip
COUNTRIES = (
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Mexico", "Norway",
    "Australia", "Italy", "Peru", "Spain", "Germany", "Vietnam", "Chile",
)  # fmt: skip

REWRITES = (
    "Rewrite this sentence to sound more polite: {text}",
    "Make this sentence shorter: {text}",
    "Fix the grammar: {text}",
    "Rewrite this for a child: {text}",
)  # fmt: skip
TEXTS = (
    "Send me the report now because I need it.", "me and him goes to school every days",
    "The meeting that we had planned for the afternoon has been moved to the morning instead.",
    "I dont know what to do about the broken window in the kitchen.",
    "Give the money back to the people who paid it.",
    "The results of the experiment were not what the team had been expecting at all.",
)  # fmt: skip


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 20), rng.randint(2, 9)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    return rng.choice(
        (
            f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? "
            "Explain your reasoning.",
            f"{name} has {a + b} {item} and gives {b} to {other}. How many are left?",
            f"A box holds {c} {item}. How many {item} are in {b} boxes? Show your work.",
            f"{name} shares {c * b} {item} equally among {c} friends. How many does each get?",
            f"What is {a} times {b}, plus {c}? Solve it step by step.",
            f"A train travels {a * 5} km in {c} hours. What is its average speed?",
        )
    )


def _one(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.55:
        topic, other = rng.sample(TOPICS, 2)
        return rng.choice(TOPIC_TASKS).format(
            topic=topic, other=other, audience=rng.choice(AUDIENCES), style=rng.choice(STYLES)
        )
    if kind < 0.65:
        return f"How do I {rng.choice(HOWTOS)}? Give me clear steps."
    if kind < 0.75:
        return _math(rng)
    if kind < 0.84:
        return f"Write a Python function that {rng.choice(CODE_TASKS)}."
    if kind < 0.89:
        return f'Translate into {rng.choice(LANGUAGES)}: "{rng.choice(SENTENCES)}"'
    if kind < 0.95:
        return rng.choice(FACTS).format(country=rng.choice(COUNTRIES))
    return rng.choice(REWRITES).format(text=rng.choice(TEXTS))


def instructions(count: int, *, seed: int = 0) -> list[str]:
    """``count`` distinct instructions, drawn in order from ``seed``."""
    rng, seen, out = random.Random(seed), set[str](), list[str]()
    for _ in range(count * 50):
        if len(out) == count:
            break
        text = _one(rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    if len(out) < count:
        raise ValueError(f"only {len(out)} distinct instructions can be drawn; asked for {count}")
    return out
