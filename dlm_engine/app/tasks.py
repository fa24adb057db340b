"""Synthetic tasks with checkable answers for the embedded tiny model.

Every task draws (prompt, reference answer) pairs from a seeded ``random.Random`` and checks a
generated answer. Two tasks have a single right answer (``add``, ``sub``); two have many
(``pick``: name a member of a category; ``split``: two digits with a given sum). On the
multi-answer tasks, decoding several positions at once from independent marginals mixes
answers ("plum" + "kiwi" -> "pliw") — the failure mode parallel strategies must avoid.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ANSWER_LENGTH = 16  # answer tokens + EOS padding; the tiny model's generation length

CATEGORIES: Dict[str, Tuple[str, ...]] = {
    "fruit": ("plum", "pear", "kiwi", "lime", "fig", "apple", "mango"),
    "color": ("red", "blue", "green", "pink", "gray", "black"),
    "animal": ("cat", "dog", "horse", "mouse", "goat", "lion"),
    "metal": ("iron", "gold", "tin", "zinc", "lead", "copper"),
    "planet": ("mars", "venus", "earth", "saturn", "jupiter"),
    "tree": ("oak", "pine", "elm", "birch", "maple", "ash"),
    "bird": ("crow", "owl", "duck", "swan", "hawk", "robin"),
    "fish": ("cod", "tuna", "carp", "trout", "perch", "eel"),
    "weekday": ("monday", "tuesday", "friday", "sunday"),
    "number": ("one", "two", "three", "seven", "nine"),
    "vowel": ("a", "e", "i", "o", "u"),
    "month": ("may", "june", "july", "march", "april"),
}


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str  # one valid reference answer


def _add(rng: random.Random) -> Example:
    a, b = rng.randrange(1000), rng.randrange(1000)
    return Example("add", f"{a:03d}+{b:03d}=", f"{a + b:04d}")


def _sub(rng: random.Random) -> Example:
    a, b = rng.randrange(1000), rng.randrange(1000)
    a, b = max(a, b), min(a, b)
    return Example("sub", f"{a:03d}-{b:03d}=", f"{a - b:03d}")


def _pick(rng: random.Random) -> Example:
    cat = rng.choice(sorted(CATEGORIES))
    return Example("pick", f"name a {cat}:", rng.choice(CATEGORIES[cat]))


def _split(rng: random.Random) -> Example:
    n = rng.randrange(19)
    a = rng.randrange(max(0, n - 9), min(9, n) + 1)
    return Example("split", f"sum {n}:", f"{a}+{n - a}")


GENERATORS: Dict[str, Callable[[random.Random], Example]] = {"add": _add, "sub": _sub, "pick": _pick, "split": _split}
DEFAULT_MIX: Dict[str, float] = {"add": 0.3, "sub": 0.25, "pick": 0.2, "split": 0.25}


def check(example_task: str, prompt: str, answer: str) -> bool:
    """Exact-match check of a generated answer (any valid answer counts for multi-answer tasks)."""
    answer = answer.strip()
    if example_task == "add":
        a, b = prompt[:-1].split("+")
        return answer == f"{int(a) + int(b):04d}"
    if example_task == "sub":
        a, b = prompt[:-1].split("-")
        return answer == f"{int(a) - int(b):03d}"
    if example_task == "pick":
        cat = prompt[len("name a "):-1]
        return answer in CATEGORIES.get(cat, ())
    if example_task == "split":
        n = int(prompt[len("sum "):-1])
        parts = answer.split("+")
        return (len(parts) == 2 and all(len(p) == 1 and p.isdigit() for p in parts)
                and int(parts[0]) + int(parts[1]) == n)
    raise KeyError(f"unknown task '{example_task}'")


def sample(rng: random.Random, mix: Optional[Dict[str, float]] = None) -> Example:
    mix = mix or DEFAULT_MIX
    names = sorted(mix)
    name = rng.choices(names, weights=[mix[n] for n in names])[0]
    return GENERATORS[name](rng)


HELD_OUT_SEED = 20261121


def held_out(n: int, tasks: Optional[Sequence[str]] = None, seed: int = HELD_OUT_SEED) -> List[Example]:
    """A fixed held-out set: ``n`` examples cycling over ``tasks`` in order (deterministic)."""
    tasks = list(tasks or sorted(GENERATORS))
    rng = random.Random(seed)
    return [GENERATORS[tasks[i % len(tasks)]](rng) for i in range(n)]


def held_out_prompts(n: int = 2000) -> set:
    """Prompts of the (large) held-out pool; training excludes these for the open-ended tasks."""
    return {e.prompt for e in held_out(n) if e.task in ("add", "sub")}


def held_out_for(task_cfg) -> List[Example]:
    """The held-out examples a ``task`` config node asks for (``n``, ``tasks``, ``seed``)."""
    names = list(task_cfg.tasks) if task_cfg.tasks else None
    unknown = sorted(set(names or []) - set(GENERATORS))
    if unknown:
        from dlm_engine.errors import ConfigError

        raise ConfigError(f"task.tasks: unknown task(s) {unknown} (available: {', '.join(sorted(GENERATORS))})")
    if task_cfg.n <= 0:
        from dlm_engine.errors import ConfigError

        raise ConfigError(f"task.n={task_cfg.n} must be a positive integer")
    return held_out(int(task_cfg.n), names, HELD_OUT_SEED if task_cfg.seed is None else int(task_cfg.seed))
