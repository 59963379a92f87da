"""One typed seam to Open WebUI (engine.Host): the real host (webui.OpenWebUI) and the test harnesses'
stand-ins implement every method of it, with the same parameters, so what a test proves through a
stand-in is what the function asks of Open WebUI. (mypy checks webui.OpenWebUI against the protocol
too, where functions/adapter.py makes it.)"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from engine import Host
from tests.support.pipe_harness import _HarnessHost
from tests.support.tool_harness import _ToolHost
from webui import OpenWebUI

MEMBERS = sorted(name for name in vars(Host) if not name.startswith("_"))


def _parameters(owner: type, name: str) -> list[tuple[str, object, object]]:
    """The method's parameters after `self` (a static method has none to drop)."""
    listed = list(inspect.signature(getattr(owner, name)).parameters.values())
    if not isinstance(inspect.getattr_static(owner, name), staticmethod):
        listed = listed[1:]
    return [(p.name, p.kind, p.default) for p in listed]


def test_the_protocol_is_the_whole_seam() -> None:
    """What the function's files and the engine call on the host is in the protocol (a method called
    but not declared would escape mypy and the stand-ins alike)."""
    root = Path(__file__).resolve().parents[2]
    called: set[str] = set()
    for folder in ("functions", "engine"):
        for path in (root / folder).glob("*.py"):
            called.update(re.findall(r"\bhost\.([a-z_]+)\(", path.read_text(encoding="utf-8")))
    assert len(called) >= 15, sorted(called)  # the walk sees them
    assert called <= set(MEMBERS), sorted(called - set(MEMBERS))


@pytest.mark.parametrize("host", [OpenWebUI, _HarnessHost, _ToolHost], ids=lambda h: h.__name__)
def test_every_host_implements_every_method_with_the_same_parameters(host: type) -> None:
    missing = [name for name in MEMBERS if not callable(getattr(host, name, None))]
    assert missing == []
    differ = {
        name: (_parameters(host, name), _parameters(Host, name))
        for name in MEMBERS
        if [p[:2] for p in _parameters(host, name)] != [p[:2] for p in _parameters(Host, name)]
    }
    assert differ == {}
    for name in MEMBERS:
        ours, theirs = getattr(host, name), getattr(Host, name)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs), name
