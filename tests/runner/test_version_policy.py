"""The version policy of the sandbox environment (sandbox/requirements.txt, docs/environment.md): each
package at the newest release on which the idioms models write still work. Where a newer major removed
a common idiom, requirements.txt caps it, with the reason beside the cap, and the lock must stay below:
a re-lock (`sandbox/lock`) that crosses a cap, or a cap dropped from requirements.txt, fails here. Each
idiom is exercised by a corpus cell (tests/corpus/), which the sandbox runs in tests/function/test_corpus.py.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import corpus

SANDBOX = Path(__file__).resolve().parents[2] / "sandbox"

# package: (the cap, the idiom the next release breaks, the corpus cells that write it)
POLICY: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "numpy": ("<2.4", "np.trapz(y, x)", ("statistics/integrate-area",)),
    "pandas": (
        "<3",
        'df["c"].fillna(v, inplace=True), DataFrame.applymap, resample("M") and freq="M", '
        'pd.read_html(literal_html), df[c].dtype == "object" for text',
        (
            "data-cleaning/fill-missing-inplace",
            "data-cleaning/applymap-clean",
            "data-cleaning/dtype-check",
            "dates/date-range-month-end",
            "dates/resample-monthly",
            "formats/html-tables-literal",
        ),
    ),
    "duckdb": ("<2", 'duckdb.sql("...").fetchone()', ("spreadsheets/duckdb-sql",)),
    "plotly": ("<7", 'fig.write_image("chart.png") offline (kaleido 0.2)', ("charts/plotly-png",)),
    "kaleido": ("<1", 'fig.write_image("chart.png") offline (its own Chromium)', ("charts/plotly-png",)),
    "pypdf2": ("<3", "PyPDF2.PdfFileReader(f).getPage(0).extractText()", ("documents/pypdf2-legacy",)),
    "opencv-python-headless": (
        "<5",
        "cv2.CascadeClassifier(cv2.data.haarcascades + ...)",
        ("images/face-detect",),
    ),
}


def requirements() -> dict[str, tuple[Requirement, str]]:
    """requirements.txt: name -> (requirement, the comment beside it)."""
    found = {}
    for line in (SANDBOX / "requirements.txt").read_text().splitlines():
        spec, _, comment = line.partition("#")
        if spec.strip():
            req = Requirement(spec.strip())
            found[canonicalize_name(req.name)] = (req, comment.strip())
    return found


def locked() -> dict[str, Version]:
    lock = SANDBOX / f"requirements.{platform.machine()}.lock"
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock.read_text(), re.MULTILINE)
    return {canonicalize_name(name): Version(version) for name, version in pins}


@pytest.mark.parametrize("package", list(POLICY))
def test_the_lock_stays_below_each_cap_of_the_policy(package: str) -> None:
    cap, idiom, _ = POLICY[package]
    version = locked()[package]
    assert version in Requirement(f"x{cap}").specifier, (
        f"the lock has {package} {version}, which breaks {idiom}: keep {package}{cap} in "
        "sandbox/requirements.txt and run sandbox/lock again"
    )
    req, comment = requirements()[package]
    assert str(req.specifier) == cap, f"sandbox/requirements.txt must cap {package}{cap} ({idiom})"
    assert "policy:" in comment, f"the reason for {package}{cap} belongs beside it in requirements.txt"


def test_every_cap_in_requirements_says_why_and_every_policy_cap_is_in_the_table() -> None:
    for name, (req, comment) in requirements().items():
        if any(spec.operator in ("<", "<=", "==", "~=") for spec in req.specifier):
            assert re.search(r"\b(policy|size):|requires", comment), f"{name}: a cap without a reason"
        if "policy:" in comment:
            assert name in POLICY, f"{name}: a policy cap that tests/runner/test_version_policy.py misses"


def test_the_lock_satisfies_requirements() -> None:
    pins = locked()
    for name, (req, _) in requirements().items():
        assert name in pins, f"{name} is not in the lock: run sandbox/lock"
        assert pins[name] in req.specifier, f"the lock's {name} {pins[name]} is not {req}"


def test_each_idiom_of_the_policy_is_a_cell_of_the_corpus_expected_to_pass() -> None:
    cells = {c.id: c for cells in corpus.load().values() for c in cells}
    for package, (_, _, ids) in POLICY.items():
        for cell_id in ids:
            assert cell_id in cells, f"{package}: no corpus cell {cell_id}"
            assert cells[cell_id].known_failure is None, f"{cell_id} is the idiom {package} is capped for"
