"""Help text conventions of every command (applied once, by :mod:`dstt.cli.main`).

* Flags (``--json``, ``--dry-run``, ``--overwrite``) show no ``<bool>`` type:
  a flag takes no value, and a type next to it reads as if it did.
* Help texts are printed as written: ``STORE[@BRANCH][:STEP]`` is reference
  syntax, not rich markup (rich would swallow ``[@BRANCH]``).
"""

from __future__ import annotations

import inspect
from typing import Any


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
        original = cls.format_help
        if getattr(original, "_dstt_patched", False):
            continue

        def format_help(self: Any, ctx: Any, formatter: Any, _original: Any = original) -> Any:
            literal_help_text()
            return _original(self, ctx, formatter)

        format_help._dstt_patched = True  # type: ignore[attr-defined]
        cls.format_help = format_help  # type: ignore[method-assign]


def hide_flag_types() -> None:
    """Make typer print no type next to boolean flags in ``--help``."""
    from typer.core import TyperOption

    original = TyperOption.display_type_rich
    if getattr(original, "_dstt_patched", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) or getattr(self, "is_bool_flag", False):
            return None
        return original(self, ctx)

    display_type_rich._dstt_patched = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def literal_help_text() -> None:
    """Render help strings as plain text (no rich markup parsing)."""
    import typer.rich_utils as ru

    original = ru._make_rich_text
    if getattr(original, "_dstt_patched", False):
        return

    def make_rich_text(*, text: str, style: str = "", markup_mode: Any) -> Any:
        if markup_mode != "rich":
            return original(text=text, style=style, markup_mode=markup_mode)
        return ru.highlighter(ru.Text(inspect.cleandoc(text), style=style))

    make_rich_text._dstt_patched = True  # type: ignore[attr-defined]
    ru._make_rich_text = make_rich_text  # type: ignore[assignment]
