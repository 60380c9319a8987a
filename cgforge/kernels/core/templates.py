"""The one Jinja environment: templates (memory and loop skeletons) under cgforge/kernels/templates."""

from __future__ import annotations

from functools import cache

import jinja2


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("cgforge.kernels", "templates"),
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=True)


def template(name: str) -> jinja2.Template:
    return _environment().get_template(name)
