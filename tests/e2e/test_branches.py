"""Branches of a conversation through a real Open WebUI 0.12.4 (HTTP only, the requests the web UI
sends): a regenerated answer continues from the files and Python state of the message before it, going
back to the first branch continues that one's, and another chat is untouched."""

from __future__ import annotations

import uuid

import pytest

from tests.support.open_webui import MODEL, Account, OpenWebUI

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]

RESTORED = "Restored the files and Python state of the message you are continuing from."
LOAD = (
    "import pandas as pd\n"
    "pd.DataFrame({'n': range(10)}).to_csv('/mnt/data/data.csv', index=False)\n"
    "df = pd.read_csv('/mnt/data/data.csv')\n"
    "print('rows', len(df))"
)
HALVE = "df = df.iloc[: len(df) // 2]\ndf.to_csv('/mnt/data/data.csv', index=False)\nprint('rows', len(df))"
LOOK = "print('df', len(df), 'file', len(pd.read_csv('/mnt/data/data.csv')))"


def run(source: str) -> str:
    return f"```python\n{source}\n```\n"


class Conversation:
    """A chat driven as the web UI drives it: every request names the user message (a new one, or the
    same one again for a regenerate) and the answer's id; Open WebUI files both in the chat's tree."""

    def __init__(self, account: Account) -> None:
        self.account = account
        self.chat_id = ""
        self.texts: dict[str, str] = {}  # message id -> its text, to send the branch's history
        self.parents: dict[str, str | None] = {}

    def history(self, message_id: str | None) -> list[dict]:
        chain = []
        while message_id is not None:
            role = "assistant" if message_id.startswith("a-") else "user"
            chain.append({"role": role, "content": self.texts[message_id]})
            message_id = self.parents[message_id]
        return chain[::-1]

    def send(self, text: str, *, parent: str | None, again: str | None = None) -> tuple[str, str]:
        """A new user message under the answer `parent`, or the user message `again` once more (a
        regenerate). Returns (answer id, answer text)."""
        user_id = again or f"u-{uuid.uuid4()}"
        answer_id = f"a-{uuid.uuid4()}"
        if again is None:
            self.texts[user_id], self.parents[user_id] = text, parent
        else:
            text, parent = self.texts[again], self.parents[again]
        payload = {
            "model": MODEL,
            "messages": [*self.history(parent), {"role": "user", "content": text}],
            "stream": False,
            "parent_id": parent,
            "user_message": {"id": user_id, "role": "user", "content": text, "parentId": parent},
            "id": answer_id,
        }
        if self.chat_id:
            payload["chat_id"] = self.chat_id
        response = self.account.post("/api/chat/completions", payload)
        assert response.status_code == 200, response.text
        content = response.json()["choices"][0]["message"]["content"]
        if not self.chat_id:
            self.chat_id = self.account._chat_of(answer_id)
        self.texts[answer_id], self.parents[answer_id] = content, user_id
        return answer_id, content

    def user_of(self, answer_id: str) -> str:
        parent = self.parents[answer_id]
        assert parent is not None
        return parent


def test_a_regenerated_or_edited_answer_and_the_first_branch_each_continue_from_their_own_state(
    open_webui: OpenWebUI,
) -> None:
    chat = Conversation(open_webui.admin)
    first, said = chat.send(run(LOAD), parent=None)
    assert "rows 10" in said, said
    second, said = chat.send(run(HALVE), parent=first)
    assert "rows 5" in said, said
    # Regenerate turn 2: Open WebUI sends the same user message again. It halves turn 1's ten rows
    # (halving the five it had left would give 2).
    _, said = chat.send("", parent=None, again=chat.user_of(second))
    assert "rows 5" in said, said
    assert RESTORED in said
    # Edit turn 2 into another instruction: a new user message under turn 1.
    _, said = chat.send(run(LOOK), parent=first)
    assert "df 10 file 10" in said, said
    # The first branch of turn 2, continued: its halved file and frame.
    _, said = chat.send(run(LOOK), parent=second)
    assert "df 5 file 5" in said, said
    assert RESTORED in said
    # Another chat of the same user is untouched by all of it.
    other = Conversation(open_webui.admin)
    look = "import os\nprint(sorted(os.listdir('/mnt/data')), 'df' in globals())"
    _, said = other.send(run(look), parent=None)
    assert "[] False" in said, said
    assert RESTORED not in said
