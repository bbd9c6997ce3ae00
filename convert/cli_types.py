"""click parameter types for values glm-pack checks itself: a bad value is a click usage error (exit 2), as a bad
choice is, with glm-pack's own explanation."""

from __future__ import annotations

import click

from glm_pack.packing.errors import GlmPackError

from .cards import card_ref, list_cards
from .plan import parse_k_pad


class _Checked(click.ParamType):
    """A string kept as given once ``check(value)`` accepts it; its GlmPackError becomes click's usage error."""

    check = staticmethod(lambda value: None)

    def convert(self, value, param, ctx):
        try:
            self.check(value)
        except GlmPackError as err:
            self.fail(err.message, param, ctx)
        return value


class CardName(_Checked):
    """A bundled card's name or a card file (``*.toml``); what the file holds is checked when it is loaded."""

    name = "card"
    check = staticmethod(card_ref)

    def get_metavar(self, param, ctx=None) -> str:
        return f"[{'|'.join(list_cards())}|FILE.toml]"


class KPad(_Checked):
    """``card``, ``none`` or a positive multiple of 32."""

    name = "k-pad"
    check = staticmethod(parse_k_pad)

    def get_metavar(self, param, ctx=None) -> str:
        return "[card|none|N]"
