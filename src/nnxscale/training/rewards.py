"""Reward functions for ``--objective grpo``: loaded from ``--reward`` specs, called on a
step's completions, their answers checked.

A reward is a Python function with TRL's signature,

    fn(prompts: list[str], completions: list[str], **fields) -> list[float]

called once per step with every completion of the step (each prompt repeated for each of its
completions) and, as keyword arguments, every other field of the prompts' rows (``answer``,
...), one value per completion. ``--reward`` names it:

- ``path/to/file.py:fn``: a function of a Python file;
- ``package.module:fn``: a function of an importable module;
- ``exact-answer``: 1.0 where the completion's final answer (its last ``\\boxed{...}``, or
  else its last number) equals the row's ``answer`` (numbers compared as numbers), else 0.0;
- ``regex:PATTERN``: 1.0 where ``re.search(PATTERN, completion)`` matches, else 0.0.

Several ``--reward`` s are summed, each times its ``--reward-weights`` entry (default 1). A
function that raises, returns the wrong number of rewards or a value that is not a finite
number stops the run with one :class:`RewardError` line naming the function and the problem.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from nnxscale.errors import NnxscaleError


class RewardError(NnxscaleError, RuntimeError):
    """A reward function that cannot be loaded, or that failed on a step's completions."""


_BOXED = re.compile(r"\\boxed\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_answer(text: str) -> Optional[str]:
    """A completion's final answer: the contents of its last ``\\boxed{...}`` (braces
    balanced), or else its last number (thousands' commas dropped); ``None`` where it has neither."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if starts:
        i, depth, out = starts[-1], 1, []
        while i < len(text):
            c = text[i]
            depth += {"{": 1, "}": -1}.get(c, 0)
            if depth == 0:
                return "".join(out).strip()
            out.append(c)
            i += 1
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def same_answer(got: Optional[str], want: Any) -> bool:
    """Whether an extracted answer equals the row's: as numbers where both are, else as text
    (whitespace and a trailing period ignored)."""
    if got is None or want is None:
        return False
    a, b = str(got).strip().rstrip("."), str(want).strip().rstrip(".")
    try:
        return math.isclose(float(a.replace(",", "")), float(b.replace(",", "")), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return a == b


def exact_answer(prompts, completions, answer=None, **_) -> list[float]:
    """1.0 where the completion's :func:`final_answer` equals the row's ``answer``."""
    if answer is None:
        raise ValueError("the prompts' rows have no 'answer' field")
    return [1.0 if same_answer(final_answer(c), a) else 0.0 for c, a in zip(completions, answer)]


def regex_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern)

    def matches(prompts, completions, **_) -> list[float]:
        return [1.0 if compiled.search(c) else 0.0 for c in completions]

    matches.__name__ = f"regex:{pattern}"
    return matches


@dataclasses.dataclass(frozen=True)
class Reward:
    """One ``--reward``: its spec (the name errors give), the function, its weight."""

    spec: str
    fn: Callable
    weight: float = 1.0


def load(spec: str) -> Callable:
    """The function a ``--reward`` spec names (see the module docstring)."""
    if spec == "exact-answer":
        return exact_answer
    if spec.startswith("regex:"):
        try:
            return regex_reward(spec[len("regex:"):])
        except re.error as e:
            raise RewardError(f"--reward {spec}: not a regular expression ({e})") from None
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise RewardError(f"--reward {spec}: give FILE.py:FUNCTION, package.module:FUNCTION, exact-answer or regex:PATTERN")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise RewardError(f"--reward {spec}: no such file {path}")
            module_spec = importlib.util.spec_from_file_location(f"nnxscale_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardError:
        raise
    except Exception as e:  # the user's module failed to import: say which and why, in one line
        raise RewardError(f"--reward {spec}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {where} has no function {name!r}")
    return fn


def load_all(specs: Sequence[str], weights: Optional[Sequence[float]] = None) -> list[Reward]:
    """The :class:`Reward` s of ``--reward`` (repeated) and ``--reward-weights``."""
    if not specs:
        raise RewardError("--objective grpo needs at least one --reward (FILE.py:FUNCTION, exact-answer, regex:PATTERN)")
    weights = [1.0] * len(specs) if not weights else list(weights)
    if len(weights) != len(specs):
        raise RewardError(f"--reward-weights gives {len(weights)} weights for {len(specs)} --reward functions")
    return [Reward(s, load(s), float(w)) for s, w in zip(specs, weights)]


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], fields: dict) -> tuple[np.ndarray, dict]:
    """``(total, each)``: ``(N,)`` float64 weighted sums of every reward over ``N``
    completions, and each reward's own ``(N,)`` values by spec. Raises :class:`RewardError`
    naming the function for an exception, a wrong count or a value that is not finite."""
    n = len(completions)
    total, each = np.zeros(n), {}
    for r in rewards:
        try:
            out = r.fn(list(prompts), list(completions), **fields)
        except Exception as e:  # the user's function: its failure ends the run in one line
            raise RewardError(f"reward {r.spec} raised {type(e).__name__}: {e}") from None
        try:
            values = np.asarray(list(out), np.float64)
        except (TypeError, ValueError):
            raise RewardError(f"reward {r.spec} returned {type(out).__name__}, not a list of {n} numbers") from None
        if values.shape != (n,):
            raise RewardError(f"reward {r.spec} returned {values.size} rewards for {n} completions")
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise RewardError(f"reward {r.spec} returned {values[bad[0]]} for completion {bad[0]} (of {n}): rewards must be "
                              "finite numbers")  # fmt: skip
        each[r.spec] = values
        total += r.weight * values
    return total, each
