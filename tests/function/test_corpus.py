"""The corpus (tests/corpus/*.md): what people ask of a code interpreter, in the code models write for
it, through the installed function, in real gVisor, on the sandbox environment.

One chat (one live kernel) per category, each cell its own message, in the file's order, so the
imports of a category are paid once and a cell can read what the one before it wrote, as in a chat.
Each cell checks its own result (asserts, or `set -euo pipefail` and tests in bash); it passes when
it ran to its end, which the marker it prints last shows. A cell marked as a known failure must still
fail: the list of what this environment cannot do stays true.
"""

from __future__ import annotations

import time

import pytest
import pytest_asyncio

from tests.support import corpus
from tests.support.pipe_harness import PipeHarness, code

pytestmark = [pytest.mark.runsc, pytest.mark.asyncio(loop_scope="module")]

USER = "corpus-user"
CATEGORIES = corpus.load()
TIMINGS: dict[str, float] = {}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def harness(tmp_path_factory: pytest.TempPathFactory) -> PipeHarness:
    # A cell may train a model or render a video: two minutes, as an admin would allow a data chat.
    harness = PipeHarness(tmp_path_factory.mktemp("corpus") / "data", valves={"timeout_seconds": 120})
    yield harness
    await harness.aclose()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("category", list(CATEGORIES))
async def test_a_category_of_model_written_cells_does_its_jobs(harness: PipeHarness, category: str) -> None:
    started = time.monotonic()
    unexpected: list[str] = []
    for cell in CATEGORIES[category]:
        answer = await harness.say(USER, f"corpus-{category}", code(cell.source(), language=cell.language))
        ran = corpus.DONE in answer
        if ran and cell.known_failure:
            unexpected.append(f"{cell.id} is listed as a known failure but passed; update the corpus")
        elif not ran and not cell.known_failure:
            unexpected.append(f"{cell.id} failed:\n{answer[-1500:]}")
    TIMINGS[category] = time.monotonic() - started
    print(f"{category}: {len(CATEGORIES[category])} cells in {TIMINGS[category]:.0f} s")
    assert not unexpected, "\n\n".join(unexpected)
