"""A generated encyclopedia whose facts chain, and the 2-hop questions it answers.

People, cities, countries, rivers and companies with made-up names, each with an article in an
encyclopedia's style. Facts link them (a person was born in a city, founded a company; a company
has its headquarters in a city; a city lies in a country, on a river), and every question needs
two of those links, so it cannot be answered from one article:

    In which country was Tavel Orsun born?      Tavel Orsun → born in Mirova → Mirova is in Quelland

Names are drawn without repeats from syllables, so no answer can be guessed from a name. Each
article also holds facts no question asks about (distractors for retrieval).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

_SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "tor", "el", "sa", "qu", "an", "dor", "ri", "mo", "bel", "tu", "za",
              "ne", "or", "vi", "lan", "cas", "pe", "hol", "du", "gra", "fen", "ost", "li", "mar", "ul")  # fmt: skip


@dataclass
class World:
    """The entities and the links between them."""

    countries: list[str] = field(default_factory=list)
    rivers: list[str] = field(default_factory=list)
    cities: dict[str, dict[str, str]] = field(default_factory=dict)  # city -> country, river
    companies: dict[str, dict[str, str]] = field(default_factory=dict)  # company -> city, product
    people: dict[str, dict[str, Any]] = field(default_factory=dict)  # person -> city, company, year


class _Names:
    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set[str]()

    def word(self, parts: int) -> str:
        return "".join(self.rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()

    def __call__(self, parts: int, suffix: str = "", *, person: bool = False) -> str:
        """A name no other entity has (a person's is two words: 2 and 3 syllables)."""
        for _ in range(10_000):
            name = f"{self.word(2)} {self.word(3)}" if person else self.word(parts) + suffix
            if name not in self.used:
                self.used.add(name)
                return name
        raise ValueError("ran out of names: ask for fewer people")


def make_world(rng: random.Random, people: int) -> World:
    """A world with `people` people and proportionally fewer places and companies."""
    name = _Names(rng)
    world = World()
    world.countries = [name(3, "land") for _ in range(max(3, people // 12))]
    world.rivers = [name(3) + " River" for _ in range(max(3, people // 10))]
    for _ in range(max(4, people // 4)):
        world.cities[name(3)] = {"country": rng.choice(world.countries), "river": rng.choice(world.rivers)}
    cities = list(world.cities)
    products = ("lamps", "bicycles", "radios", "maps", "ships", "clocks", "paper", "glass")
    for _ in range(max(3, people // 3)):
        world.companies[name(3) + " Works"] = {"city": rng.choice(cities), "product": rng.choice(products)}
    companies = list(world.companies)
    for _ in range(people):
        full = name(0, person=True)
        world.people[full] = {"city": rng.choice(cities), "company": rng.choice(companies),
                              "year": rng.randint(1820, 1990)}  # fmt: skip
    return world


def articles(world: World, rng: random.Random) -> list[dict[str, str]]:
    """One article per entity: `id`, `title`, `text`."""
    docs = []
    for country in world.countries:
        cities = [c for c, v in world.cities.items() if v["country"] == country]
        text = f"{country} is a country. Its cities include {', '.join(cities[:4]) or 'none of note'}."
        docs.append({"title": country, "text": text})
    for river in world.rivers:
        text = f"The {river} is {rng.randint(80, 2400)} km long and is crossed by {rng.randint(2, 40)} bridges."
        docs.append({"title": river, "text": text})
    for city, facts in world.cities.items():
        text = (f"{city} is a city in {facts['country']}. It lies on the {facts['river']} and has about "
                f"{rng.randint(5, 900) * 1000} inhabitants.")  # fmt: skip
        docs.append({"title": city, "text": text})
    for company, facts in world.companies.items():
        text = f"{company} is a maker of {facts['product']}. Its headquarters are in {facts['city']}."
        docs.append({"title": company, "text": text})
    for person, facts in world.people.items():
        text = (f"{person} (born {facts['year']}) is an engineer. {person.split()[0]} was born in {facts['city']} "
                f"and founded {facts['company']}.")  # fmt: skip
        docs.append({"title": person, "text": text})
    return [{"id": f"doc-{i}", **doc} for i, doc in enumerate(docs)]


def questions(world: World, rng: random.Random) -> list[dict[str, Any]]:
    """One 2-hop question per person: `question`, `golden_answers`, and the chain of titles it needs."""
    out = []
    for person, facts in world.people.items():
        city, company = facts["city"], facts["company"]
        kind = rng.randrange(3)
        if kind == 2 and world.companies[company]["city"] == city:
            kind = 0  # the person's own article would name the answer: not a 2-hop question
        if kind == 0:
            q, a, chain = f"In which country was {person} born?", world.cities[city]["country"], [person, city]
        elif kind == 1:
            q, a, chain = f"Which river flows through the city where {person} was born?", \
                world.cities[city]["river"], [person, city]  # fmt: skip
        else:
            q, a = f"In which city is the company founded by {person} headquartered?", world.companies[company]["city"]
            chain = [person, company]
        out.append({"question": q, "golden_answers": [a], "chain": chain})
    return out
