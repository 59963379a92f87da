"""The kernel's wire, one source for both sides: the kernel program's modules use these constants, and so
does the host's strict decoder (runner/_wire.py). Standard library only, nothing imported: this module
is also part of the program the sandbox runs.

A frame is a 4-byte big-endian length N, then N bytes of UTF-8 JSON encoding one object. Requests
arrive on the kernel's original fd 0; replies leave on its original fd 1:

    host -> kernel   {"t": "run", "id": int, "lang": "python" | "bash", "code": str}    EOF: exit 0
    kernel -> host   {"t": "ready", "v": 2, "python": "3.11.2", "pid": int, "packages": {name: version|null}}
                     {"t": "out", "id": int, "s": "o" | "e", "d": str (at most 16384 characters)}
                     {"t": "done", "id": int, "status": "ok" | "error" | "interrupted",
                      "exit_code": int | null, "figures": [str], "more": int, "ms": float}
                     ("figures": figure-N.png and chart-N.plotly.json names; "more": figures left
                      open past MAX_FIGURES_PER_RUN, not saved)

One run at a time; every "out" of a run precedes its "done"; nothing is written between a "done" and the
next request. The cell runs inside the kernel's process, so it can write anything to the reply channel:
the host must treat every frame as hostile.
"""

from __future__ import annotations

PROTOCOL_VERSION = 2
MAX_TEXT = 16 * 1024  # characters of text per "out" frame (the host refuses more)
MAX_REQUEST = 64 * 1024 * 1024  # bytes of one request frame (the code of one cell)
# The one bound on a run's figures: saved and shown (the host's wire refuses a "done" listing more).
# The rest are counted ("more"), never saved later: they belong to this run's answer, not the next.
MAX_FIGURES_PER_RUN = 20
DEFAULT_WORKDIR = "/mnt/data"
WORKDIR_ENV = "CODE_SESSIONS_WORKDIR"
FATAL_EXIT = 70  # EX_SOFTWARE: the kernel itself failed; the host restarts it
