"""A progress bar on stderr: tqdm's when it is installed, else one plain line per step."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any


class Progress:
    """`with Progress("loading", total=3) as p: ...; p.advance()`; `p.set(n, note)` jumps to a count."""

    def __init__(self, description: str, total: int) -> None:
        self.description = description
        self.total = total
        self.count = 0
        self._bar: Any = None
        self._redirect: Any = None
        self._started = time.monotonic()

    def __enter__(self) -> Progress:
        try:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
        except ImportError:
            self._line("started")
        else:
            self._bar = tqdm(total=self.total, desc=self.description, file=sys.stderr, leave=True,
                             bar_format="{desc}: {n_fmt}/{total_fmt} |{bar:24}| {elapsed}{postfix}")
            # log lines print above the bar instead of through it
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
        return self

    def advance(self, note: str = "") -> None:
        self.set(self.count + 1, note)

    def set(self, count: int, note: str = "") -> None:
        count = min(count, self.total)
        if self._bar is not None:
            self._bar.update(count - self.count)
            if note:
                self._bar.set_postfix_str(note)
        elif count != self.count or note:
            self._line(f"{count}/{self.total}" + (f" {note}" if note else ""))
        self.count = count

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._bar is not None:
            self._redirect.__exit__(kind, error, traceback)
            self._bar.close()
        elif kind is None:
            self._line(f"done in {time.monotonic() - self._started:.1f} s")

    def _line(self, text: str) -> None:
        print(f"{self.description}: {text}", file=sys.stderr, flush=True)
