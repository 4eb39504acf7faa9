"""The click parameter types of the commands: durations, sizes, positive finite numbers."""

from __future__ import annotations

import click

from ..config import parse_duration, parse_size


class Duration(click.ParamType):
    """A duration such as 90s, 5m or 1h30m (kept as text; parsed in one place, config.parse_duration)."""

    name = "duration"

    def __init__(self, allow: tuple[str, ...] = ()) -> None:
        self.allow = allow

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        if value is None or value in self.allow:
            return value
        try:
            parse_duration(str(value))
        except ValueError as e:
            extra = f" or {' / '.join(self.allow)}" if self.allow else ""
            self.fail(f"{e}{extra}", param, ctx)
        return str(value)


class Size(click.ParamType):
    """A size such as 256MB, 2GiB or a number of bytes (kept as text; parsed in one place, config.parse_size)."""

    name = "size"

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        if value is None:
            return value
        try:
            parse_size(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return str(value)


class PositiveFinite(click.FloatRange):
    """A float above 0 that is a number: click's FloatRange lets ``nan`` (every comparison is False) and ``inf``
    through, and a nan learning rate trains to the end on NaN weights."""

    name = "positive number"

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        number = super().convert(value, param, ctx)
        if number != number or number in (float("inf"), float("-inf")):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


# Folder options checked up front (empty, too long for the file system) before anything is created.
