"""The cells and sentences the branch and clone tests share (function and end to end): a frame of ten
rows loaded and saved, then halved or cut to one, each step printing its row count, so an answer shows
which message's files and Python state it continued from."""

from __future__ import annotations

LOAD = (
    "import pandas as pd\n"
    "pd.DataFrame({'n': range(10)}).to_csv('/mnt/data/data.csv', index=False)\n"
    "df = pd.read_csv('/mnt/data/data.csv')\n"
    "print('rows', len(df))"
)
HALVE = "df = df.iloc[: len(df) // 2]\ndf.to_csv('/mnt/data/data.csv', index=False)\nprint('rows', len(df))"
ONE = "df = df.iloc[:1]\ndf.to_csv('/mnt/data/data.csv', index=False)\nprint('rows', len(df))"
LOOK = "print('df', len(df), 'file', len(pd.read_csv('/mnt/data/data.csv')))"

RESTORED = "Restored the files and Python state of the message you are continuing from."
OWN_CLONE = "Python state of the chat it was cloned from"
SHARED_CLONE = "This chat is a clone of a chat shared with you"
