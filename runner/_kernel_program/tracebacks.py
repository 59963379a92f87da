"""A cell's traceback as `python3 cell.py` would print it: without the kernel's own frames."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Frames of the kernel's file (the joined program is one file for all its modules) are kernel frames:
# hidden from the cell's tracebacks.
_KERNEL_SOURCE = (lambda: None).__code__.co_filename


def _strip_kernel_frames(te: Any, seen: set[int]) -> None:
    """Drop the kernel's frames (the exec call, the SIGINT handler) from a TracebackException tree."""
    import traceback

    if id(te) in seen:
        return
    seen.add(id(te))
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != _KERNEL_SOURCE])
    for sub in (te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or ())):
        if sub is not None:
            _strip_kernel_frames(sub, seen)


def format_cell_exception(exc: BaseException) -> str:
    import traceback

    try:
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
        _strip_kernel_frames(te, set())
        return "".join(te.format())
    except Exception as failure:  # a hostile exception object must not take the kernel down
        return f"{type(exc).__name__} (the traceback could not be formatted: {failure!r})\n"
