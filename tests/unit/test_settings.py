"""`mmpipe.settings`: every switch is in the module's table, and each boolean switch reads its
variable (off with "0", its default when unset)."""

from __future__ import annotations

import dataclasses

import mmpipe.settings as settings_module
from mmpipe.settings import Settings


def test_every_switch_is_in_the_table_and_reads_its_variable():
    table = settings_module.__doc__
    defaults = Settings.from_environ({})
    for field in dataclasses.fields(Settings):
        rows = [line for line in table.splitlines() if f"| `{field.name}` |" in line]
        assert len(rows) == 1, f"{field.name} is not in the settings table once"
        if field.type not in ("bool", bool):
            continue
        variable = rows[0].split("`")[1]
        flipped = Settings.from_environ({variable: "0" if getattr(defaults, field.name) else "1"})
        assert getattr(flipped, field.name) is not getattr(defaults, field.name), variable
        assert all(getattr(flipped, other.name) == getattr(defaults, other.name)
                   for other in dataclasses.fields(Settings) if other.name != field.name), variable
