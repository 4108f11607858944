"""Rank 0's progress display: which probe phase is running and for how long.

It reads the `tpprobe.capture.progress.Progress` object the probe already updates at each phase
(`progress.set(phase, where)`), so the pipeline needs no other call than start/stop. It stays
invisible for phases shorter than `delay` seconds, draws nothing under --quiet / --json or when
stdout is not a terminal, and is transient: it disappears before the report is rendered
(`tpprobe.report.emit.console()` calls `stop_all()`). Colours follow rich (NO_COLOR respected).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from rich.console import Console, Group
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

PHASE_LABEL = {"start": "starting", "build": "building the model", "forward": "forward under the hooks",
               "write": "writing this rank's capture", "exchange": "exchanging captures between ranks",
               "report": "checks and report", "verdict": "waiting for rank 0's verdict"}
_ACTIVE: set = set()     # the live displays on screen now: one terminal per process, emptied when each stops
_LOCK = threading.Lock()


def stop_all() -> None:
    """End every running display (before anything else is printed to the terminal)."""
    with _LOCK:
        active = list(_ACTIVE)
    for lp in active:
        lp.stop()


class LiveProgress:
    """`with LiveProgress(progress, enabled=rank == 0 and not quiet):` around the pipeline."""

    def __init__(self, progress, enabled: bool = True, delay: float = 0.5, console: Optional[Console] = None,
                 refresh_per_second: float = 8.0):
        self.progress, self.delay, self.rps = progress, delay, refresh_per_second
        self.console = console or Console(highlight=False)
        self.enabled = bool(enabled) and self.console.is_terminal and (console is not None or sys.stdout.isatty())
        self._live = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._t0 = time.time()
        self._phase: Optional[str] = None
        self._phase_t = self._t0
        self._done: list[tuple[str, float]] = []     # (phase, seconds) of finished phases
        self._spinner = Spinner("dots", style="cyan")

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "LiveProgress":
        if not self.enabled or self._thread is not None:
            return self
        with _LOCK:
            _ACTIVE.add(self)
        self._thread = threading.Thread(target=self._loop, name="tpprobe-live", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2)
        with _LOCK:
            _ACTIVE.discard(self)
        self._close_live()

    def __enter__(self) -> "LiveProgress":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the display -----------------------------------------------------------------------------
    def _observe(self) -> None:
        phase = getattr(self.progress, "phase", None)
        if phase != self._phase:
            now = time.time()
            if self._phase is not None and self._phase in PHASE_LABEL:
                self._done.append((self._phase, now - self._phase_t))
            self._phase, self._phase_t = phase, now

    def renderable(self):
        self._observe()
        now = time.time()
        rows = Table.grid(padding=(0, 1))
        rows.add_column(width=2)
        rows.add_column()
        rows.add_column(justify="right")
        for ph, dt in self._done:
            if dt >= self.delay:
                rows.add_row(Text("✓", style="green"), Text(PHASE_LABEL.get(ph, ph), style="dim"),
                             Text(f"{dt:.1f}s", style="dim"))
        if self._phase in PHASE_LABEL:
            where = getattr(self.progress, "where", "") or ""
            label = Text(PHASE_LABEL[self._phase])
            if where:
                label.append(f" · {where}", style="dim")
            rows.add_row(self._spinner, label, Text(f"{now - self._phase_t:.1f}s"))
        head = Text(f"tpprobe · {now - self._t0:.1f}s", style="bold")
        return Group(head, rows)

    def _loop(self) -> None:
        from rich.live import Live
        tick = 1.0 / self.rps
        while not self._stop.wait(tick):
            self._observe()
            if self._phase in (None, "done") or self._phase not in PHASE_LABEL:
                if self._phase == "done":
                    break
                continue
            if self._live is None and time.time() - self._phase_t >= self.delay:
                try:
                    self._live = Live(get_renderable=self.renderable, console=self.console, transient=True,
                                      refresh_per_second=self.rps, redirect_stdout=False, redirect_stderr=False)
                    self._live.start()
                except Exception:
                    self._live = None
                    break
        self._close_live()

    def _close_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            try:
                live.stop()
            except Exception:
                pass


def attach(progress, rank: int, quiet: bool) -> LiveProgress:
    """The one call the probe makes: a started display on rank 0 unless quiet."""
    return LiveProgress(progress, enabled=(rank == 0 and not quiet)).start()
