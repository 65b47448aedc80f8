"""Progress bars on long work (loading resident constants, lowering): tqdm on stderr, only for a person.

``progress=None`` (auto) shows a bar only when stderr is a terminal and the work is large: more than
``LOAD_BYTES`` of constants to copy to a device, or a lowering still running after ``LOWER_DELAY_S``
seconds. ``progress=True`` forces a bar, ``progress=False`` never shows one. Captured or redirected
output (CI logs, pipes, notebooks' captured stderr) never gets one in auto mode.

A leaf module: the runtime and the lowering side both import it, and it imports nothing of either.
"""

from __future__ import annotations

import sys

LOAD_BYTES = 256 << 20  # auto: a bar when a method load copies more than this many constant bytes
LOWER_DELAY_S = 2.0  # auto: a lowering bar appears once lowering has run this long


def interactive() -> bool:
    """Whether stderr is a terminal (a person is watching)."""
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def wanted(progress: bool | None, large: bool = True) -> bool:
    """``progress`` when given; auto (None): large work on a terminal."""
    if progress is not None:
        return bool(progress)
    return large and interactive()


class _NoBar:
    """What :func:`bar` returns when no bar is shown: every call does nothing."""

    shown = False

    def update(self, n: int = 1) -> None:
        pass

    def step(self, label: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Bar(_NoBar):
    """A tqdm bar; :meth:`step` counts the previous step done and names the next one."""

    shown = True

    def __init__(self, **kwargs):
        from tqdm import tqdm

        self._tqdm = tqdm(file=sys.stderr, dynamic_ncols=True, leave=False, **kwargs)
        self._open_step = False

    def update(self, n: int = 1) -> None:
        self._tqdm.update(n)

    def step(self, label: str) -> None:
        self._tqdm.set_postfix_str(label, refresh=False)
        if self._open_step:
            self._tqdm.update(1)  # shows the new label (once the bar is due: see ``delay``)
        elif self._tqdm.delay <= 0:
            self._tqdm.refresh()
        self._open_step = True

    def close(self) -> None:
        if self._open_step and self._tqdm.n < (self._tqdm.total or 0):
            self._tqdm.update(1)
        self._tqdm.close()


def bar(desc: str, total: int, progress: bool | None, large: bool = True, unit: str = "it",
        delay: float = 0.0) -> _NoBar:
    """A progress bar over ``total`` units of work, or one that shows nothing (see :func:`wanted`).

    ``unit="B"`` counts bytes (shown scaled, KiB/MiB/GiB). ``delay``: in auto mode, show the bar only
    once the work has run that long (a forced bar shows at once). Use it as a context manager, or call
    ``close()``."""
    if not wanted(progress, large):
        return _NoBar()
    # Bytes scaled (KiB, MiB, ...); steps are few and slow, each shown as it starts.
    options = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else dict(mininterval=0.0)
    return _Bar(desc=desc, total=total, unit=unit, delay=delay if progress is None else 0.0, **options)
