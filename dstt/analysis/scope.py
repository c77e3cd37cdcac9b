"""What ``find`` and the report look at unless told otherwise: the default
scope rule (torch-free, by name and value only).

Looked at by default:

* **tensors** outside ``optim/`` and ``rng/``: the model's parameters and
  buffers (``model/*``) and any other tensor you saved, except counters and
  data offsets (below). Optimizer state moves because the model does (its
  jumps are echoes, and ``exp_avg_sq`` grows by orders of magnitude early
  in a run); RNG states change every step by design;
* **values** (the step's non-tensor tree): every float under ``extra``
  (a loss, a grad norm, an accuracy), the optimizer's hyperparameters
  (``optim/param_groups/N/lr`` and the other floats of a parameter group),
  and floats of the scheduler state (``scheduler/_last_lr/0``);

never:

* ``rng/*`` (random generator states);
* **counters and data offsets**: a tensor or value whose last path part is,
  or has as an ``_``-separated word, one of :data:`COUNTER_WORDS`
  (``optim/w/step``, ``extra/next_ix``, ``extra/iter_num``,
  ``scheduler/last_epoch``), and every integer value (a float lr is never
  stored as an int; a step count always is).

A tensor glob or value path given to ``find`` replaces the rule: ``dstt
find run 'optim/*'`` looks at optimizer state, ``dstt find run
extra/next_ix`` at the offsets.

>>> [n for n in ["model/w", "optim/w/exp_avg", "optim/w/step", "rng/torch", "extra/next_ix", "w"]
...  if default_tensor(n)]
['model/w', 'w']
>>> [p for p, v in [("extra/loss", 2.5), ("extra/iter_num", 120), ("extra/tokens_seen", 1e6),
...                 ("optim/param_groups/0/lr", 0.1), ("scheduler/last_epoch", 3.0), ("rng/x/0", 1.5)]
...  if default_value(p, v)]
['extra/loss', 'optim/param_groups/0/lr']
"""

from __future__ import annotations

import re
from typing import Any

#: Words naming counters and data offsets: a name whose last part is one of
#: these, or holds one as an ``_``-separated word, is not looked at by default.
COUNTER_WORDS = ("step", "steps", "iter", "iters", "iteration", "iterations", "epoch", "epochs", "ix", "idx",
                 "index", "indices", "offset", "offsets", "pos", "position", "seed", "count", "counter",
                 "tokens", "samples", "batch", "batches", "num", "seen", "cursor")
#: Top-level sections never looked at by default.
SKIPPED_ROOTS = ("rng",)
#: Top-level sections whose tensors are not looked at by default (their
#: floats values -- an optimizer's hyperparameters -- are).
TENSOR_SKIPPED_ROOTS = ("rng", "optim")
#: Top-level sections whose float values are looked at by default.
VALUE_ROOTS = ("extra", "optim", "scheduler")

_WORDS = re.compile(r"[_.\-\s]+")


def is_counter(name: str) -> bool:
    """A counter or data offset, by the last part of its name (a list
    index such as ``/0`` is skipped over).

    >>> is_counter("optim/w/step"), is_counter("extra/next_ix"), is_counter("scheduler/_step_count")
    (True, True, True)
    >>> is_counter("extra/loss"), is_counter("scheduler/_last_lr/0"), is_counter("model/pos_emb.weight")
    (False, False, False)
    """
    parts = [p for p in name.split("/") if p and not p.isdigit()]
    if not parts or name.startswith("model/"):
        return False  # a model's tensor is never a counter (``pos_emb``, ``step_proj``)
    words = [w for w in _WORDS.split(parts[-1].lower().replace("%2f", "/")) if w]
    return any(w in COUNTER_WORDS for w in words)


def default_tensor(name: str) -> bool:
    """Is this tensor in the default scope?"""
    return name.split("/", 1)[0] not in TENSOR_SKIPPED_ROOTS and not is_counter(name)


def default_value(path: str, value: Any) -> bool:
    """Is this value (a leaf of a step's value tree) in the default scope?
    Floats only (bools, ints and strings are flags, counters and names)."""
    if not isinstance(value, float) or path.split("/", 1)[0] not in VALUE_ROOTS:
        return False
    if path.startswith("optim/") and "/param_groups/" not in f"/{path}":
        return False
    return not is_counter(path)


def rising_only(path: str) -> bool:
    """Values judged on rises only (a loss or a norm falling is training
    working): a path whose last part mentions ``loss``, ``norm``, ``grad``
    or ``perplexity``/``ppl``.

    >>> rising_only("extra/train_loss"), rising_only("extra/grad_norm"), rising_only("optim/param_groups/0/lr")
    (True, True, False)
    """
    last = path.rsplit("/", 1)[-1].lower()
    return any(w in last for w in ("loss", "norm", "grad", "perplexity", "ppl"))
