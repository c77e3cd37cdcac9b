"""Help text conventions of every command (applied once, by :mod:`dstt.cli.main`).

* Flags (``--json``, ``--dry-run``, ``--overwrite``) show no ``<bool>`` type:
  a flag takes no value, and a type next to it reads as if it did.
* Help texts are printed as written: ``STORE[@BRANCH][:STEP]`` is reference
  syntax, not rich markup (rich would swallow ``[@BRANCH]``).
"""

from __future__ import annotations

import inspect
from typing import Any

#: The typer functions already replaced (by qualified name): ``apply`` is idempotent.
PATCHED: set[str] = set()


def _first_time(name: str) -> bool:
    """True the first time ``name`` is patched (and it is marked patched)."""
    if name in PATCHED:
        return False
    PATCHED.add(name)
    return True


def apply() -> None:
    """Install both conventions (idempotent).

    >>> apply(); apply(); literal_help_text()
    >>> import typer.rich_utils as ru
    >>> ru._make_rich_text(text="STORE[@BRANCH]", markup_mode="rich").plain
    'STORE[@BRANCH]'
    """
    hide_flag_types()
    # typer.rich_utils costs ~60 ms to import: patched only when help is printed
    from typer.core import TyperCommand, TyperGroup

    for cls in (TyperCommand, TyperGroup):
        if not _first_time(f"{cls.__name__}.format_help"):
            continue
        original = cls.format_help

        def format_help(self: Any, ctx: Any, formatter: Any, _original: Any = original) -> Any:
            literal_help_text()
            return _original(self, ctx, formatter)

        cls.format_help = format_help  # type: ignore[method-assign]


def hide_flag_types() -> None:
    """Make typer print no type next to boolean flags in ``--help``."""
    from typer.core import TyperOption

    if not _first_time("TyperOption.display_type_rich"):
        return
    original = TyperOption.display_type_rich

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) or getattr(self, "is_bool_flag", False):
            return None
        return original(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def literal_help_text() -> None:
    """Render help strings as plain text (no rich markup parsing)."""
    import typer.rich_utils as ru
    from rich.text import Text

    if not _first_time("rich_utils._make_rich_text"):
        return
    original = ru._make_rich_text

    def make_rich_text(*, text: str, style: str = "", markup_mode: Any) -> Any:
        if markup_mode != "rich":
            return original(text=text, style=style, markup_mode=markup_mode)
        return ru.highlighter(Text(inspect.cleandoc(text), style=style))

    ru._make_rich_text = make_rich_text
