"""One chat step, composed: lock the session, check the quota, run in the sandbox, index, enforce, link.

This is the whole "full path" a model's code takes (`ChatSession.run`), and `Engine`, the store, the
runner and the kernel pool of a process composed. It knows nothing of Open WebUI: a message's turn
(engine/turn.py) opens the chat with the message's settings and gets back results to show.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from runner import KernelPool, KernelSettings, Limits, Outcome, Runner, RunnerError, RunResult
from storage import (
    CLEAR_FILES_COMMAND,
    CleanupReport,
    DiskFull,
    FileMissing,
    InvalidPath,
    Link,
    Purge,
    ReconcileReport,
    Session,
    StorageBusy,
    StorageError,
    Store,
    human_bytes,
)

from .branches import Branches, Place
from .charts import charts_of, figures_of
from .links import References, Target, resolve_all
from .markup import escape_text, mention
from .scan import SCAN_ON_LOOP_CHARS
from .settings import LOCK_WAIT_S, Settings
from .step import StepResult
from .streaming import StreamingRewriter

__all__ = ["ChatSession", "Engine", "StepResult", "Waiting"]

Waiting = Callable[[], Awaitable[None]]

log = logging.getLogger("code_sessions.engine")

# A step reconciles only the paths its run changed; the whole folder is listed at a session's first
# step in this process and at least this often after, so a change the runner's watch missed cannot
# leave the index wrong for long (the disk is the truth).
FULL_RECONCILE_EVERY_S = 600.0

# Files an answer saved without naming them, handed over by name (or attached) at most this many.
_HANDED_OVER = 20


class ChatSession:
    """A chat's folder as the engine uses it: run code in it, add uploads, link its files."""

    def __init__(self, service: Engine, session: Session, settings: Settings) -> None:
        self._service = service
        self.session = session
        self.settings = settings  # the message's (frozen): its limits are every run's of this chat here
        # Every file linked so far, for attaching to the message. A dict: insertion order, and O(1)
        # membership (a list made an answer with 1,000 links quadratic).
        self._published: dict[Target, None] = {}
        # Files that exist but could not be linked (a full disk, the copies' quota), and why.
        self._unlinked: dict[str, str] = {}
        # The published copies behind those targets, by ref (for attaching them to the message).
        self._links: dict[str, Link] = {}
        # Files the answer's text names (as links or inline images), and the images it shows inline:
        # a file is shown once in the text, and an image shown inline is not an attachment as well.
        self._shown: dict[str, None] = {}  # ordered: previews follow the order of the links
        self._inline: set[str] = set()
        # Where this answer is in the conversation (None: the host did not say; the folder is then the
        # chat's whole, as it is), and what following it there said, for the answer's first step.
        self.place: Place | None = None
        self.follows: str | None = None  # the message whose state the answer continues (branches)
        self._branch_notes: list[str] = []
        # Files a run that was cut short (the answer stopped mid-run) added or changed: no step
        # reports them, so the answer's end hands them over.
        self.cut_short: list[str] = []

    @property
    def store(self) -> Store:
        """The store the chat's session is in."""
        return self._service.store

    @property
    def lock_timeout_s(self) -> float:
        """How long the chat's lock is waited for before the chat is said to be busy."""
        return self._service.lock_timeout_s

    @property
    def kernel_key(self) -> str:
        """The key of this chat's kernel in the kernel pool."""
        return _kernel_key(self.session.user_key, self.session.chat_key)

    @property
    def published(self) -> list[Target]:
        """Every file linked so far, in the order first linked."""
        return list(self._published)

    @property
    def links(self) -> list[Link]:
        """The published copies behind every file linked so far, each once, in the order first linked."""
        return list(self._links.values())

    @property
    def attachments(self) -> list[Link]:
        """The copies to show as the message's attachments: every file linked, except the images the
        text already shows inline."""
        return [link for link in self._links.values() if link.url not in self._inline]

    @property
    def shown(self) -> list[str]:
        """The files the answer's text names, in the order first named."""
        return list(self._shown)

    async def read_in_sandbox(self, code: str, limits: Limits) -> RunResult:
        """Our own code (never the model's) in a fresh sandbox over this chat's folder, under its lock:
        reading a hostile file with parsers that are safer kept inside gVisor (table previews)."""
        async with self.session.lock(timeout=self._service.lock_timeout_s):
            return await self._service.runner.run(code, "python", self.session.path, limits)

    @property
    def inline_urls(self) -> frozenset[str]:
        """The URLs of the images the answer's text shows inline."""
        return frozenset(self._inline)

    async def hand_over(self, paths: Sequence[str], *, attachments: bool) -> str:
        """Make sure every file the answer's runs saved reaches the user once: the files the text has
        not named are published, then either left to the message's attachments (`attachments`: the
        host shows every linked file under the message) or named in one short line, which is returned."""
        missing = [p for p in dict.fromkeys(paths) if p not in self._shown and p not in self._unlinked]
        if not missing:
            return ""
        shown, more = missing[:_HANDED_OVER], len(missing) - _HANDED_OVER
        tail = f" and {more} more in /mnt/data" if more > 0 else ""
        if not attachments:
            line = "Saved: " + ", ".join(mention(p) for p in shown) + tail
            return "\n\n" + await self.rewrite(line, inline_images=False) + "\n"
        for path in shown:
            await self._publish(path)
        return f"\n\n_{more} more files saved in /mnt/data._\n" if more > 0 else ""

    def unlinked_notes(self) -> list[str]:
        """One sentence per file the answer named that exists but could not be linked; then forgotten."""
        notes = [f"Not linked: {mention(path)}: {escape_text(why)}" for path, why in self._unlinked.items()]
        self._unlinked.clear()
        return notes

    async def follow(
        self, place: Place | None, *, waiting: Waiting | None = None, runs_here: bool = True
    ) -> list[str]:
        """This chat's answer is at `place`: put the folder and kernel at the state of the message it
        continues from (engine/branches.py), before anything is copied in or run. Returns what to
        tell the user (nothing when it continues the newest answer); the answer's first run tells the
        model too: this one's (`runs_here`), or another's of the same answer (the Filter's inlet
        restores, the Tool's run in another worker says it)."""
        self.place = place
        if place is None:
            return []
        branches = self._service.branches
        try:
            async with self.session.lock(timeout=self._service.lock_timeout_s, waiting=waiting):
                said = await branches.ensure(self, changing=False)
        except StorageError as error:  # a busy or full store: the answer goes on from the folder as it is
            log.warning("code-sessions: the answer's branch could not be followed: %s", error)
            return []
        if runs_here:
            self._branch_notes.extend(branches.take_said(self))
        return said

    def save_state_soon(self) -> None:
        """The answer is over: its state is saved in the background, for a later branch."""
        self._service.branches.save_answer_soon(self)

    async def claim_place(self) -> str:
        """The answer is about to give out something that changes the folder later (an upload link):
        the folder is put at the answer's state now, and becomes its. Returns the answer's message id,
        whose state such a change joins ("": the answer has no place in the conversation here, or
        branch states are off)."""
        if self.place is None or self.settings.branches.states == 0:
            return ""
        async with self.session.lock(timeout=self._service.lock_timeout_s):
            self._branch_notes.extend(await self._service.branches.ensure(self, changing=True))
        return self.place.message_id

    async def run(self, code: str, language: str, *, waiting: Waiting | None = None) -> StepResult:
        """Run code in this chat's folder. `waiting` is awaited once if another step of this chat
        holds the folder, so the user can be told the step waits rather than runs."""
        service = self._service
        if language not in ("python", "bash"):
            return StepResult(language, code, refused=f"unknown language {language!r}; use python or bash")
        notes: list[str] = []
        result: RunResult | None = None
        report: ReconcileReport | None = None
        try:
            async with self.session.lock(timeout=service.lock_timeout_s, waiting=waiting):
                notes.extend(self._branch_notes)
                self._branch_notes.clear()
                # Another tab's step may have moved the folder to its branch since the answer began.
                notes.extend(await service.branches.ensure(self, changing=True))
                # Two hops to other threads (the index's, the marker's) that need not wait for each other.
                budget, _ = await asyncio.gather(self.session.run_budget(), self.session.begin_run())
                if budget.note:
                    notes.append(budget.note)
                configured = self.settings.limits
                limits = configured.model_copy(
                    update={
                        "max_write_bytes": _tighter(configured.max_write_bytes, budget.max_write_bytes),
                        "max_file_bytes": _tighter(configured.max_file_bytes, budget.max_file_bytes),
                    }
                )
                try:
                    result = await service.execute(
                        self.session, code, language, limits, self.settings.kernels
                    )
                finally:
                    # Index what the run left even when the runner failed half-way: disk is the truth.
                    report = await service.reconcile_after(self.session, result)
                    if result is None:  # cut short (the answer stopped): its files, for the answer's end
                        self._cut_short(report)
                await self._record(language, code, result, report)
        except DiskFull as error:
            # The run (if any) happened; what it wrote is indexed by the next step, which lists the
            # whole folder (the mark of this run stays).
            log.warning(
                "disk full in chat %r of user %r: %s", self.session.chat_id, self.session.user_id, error
            )
            notes.append(str(error))
            if result is None:
                return StepResult(language, code, refused=str(error))
        except StorageBusy as error:
            return StepResult(language, code, refused=f"this chat's folder is busy ({error}); try again")
        except RunnerError as error:
            log.warning("sandbox unavailable: %s", error)
            return StepResult(language, code, refused=f"the sandbox is not available: {error}")
        try:
            figures, charts = figures_of(result, report), charts_of(result, report)
        except BaseException:
            self._cut_short(report)
            raise
        return StepResult(
            language, code, run=result, files=report, notes=tuple(notes), figures=figures, charts=charts
        )

    async def _record(self, language: str, code: str, result: RunResult, report: ReconcileReport) -> None:
        """Keep the run's record with its answer (what a notebook export of the answer's branch reads,
        storage/_history_runs.py): under the chat's lock, its figures as the folder has them now. A
        record that cannot be kept is logged, never the run's failure."""
        if self.place is None or self.settings.branches.states == 0:  # nothing kept beside the folder
            return
        try:
            gone = {r.path for r in report.quota_removed}
            saved = sorted(p for p in {*report.added, *report.changed} if p not in gone and _is_picture(p))
            # What the answer showed of the run: its figures, its charts' pictures, the pictures it saved.
            shown = [*figures_of(result, report), *(p for _, p in charts_of(result, report) if p), *saved]
            figures = list(dict.fromkeys(shown))
            await self.session.history.add_run(
                self.place.message_id,
                language=language,
                code=code,
                outcome=str(result.outcome),
                stdout=result.stdout,
                stderr=result.stderr,
                figures=figures,
            )
        except Exception as error:  # the run happened: a record not kept is said in the log only
            log.warning("code-sessions: the record of a run was not kept: %s", error)

    def _cut_short(self, report: ReconcileReport | None) -> None:
        """A run whose step will not be reported: its files are handed over at the answer's end."""
        if report is not None:
            gone = {r.path for r in report.quota_removed}
            self.cut_short.extend(p for p in (*report.added, *report.changed) if p not in gone)

    async def add_upload(
        self, name: str, data: bytes, *, source: str | None = None, waiting: Waiting | None = None
    ) -> str:
        """Copy a user's attachment into the folder under a safe, unused name; returns its path.
        Raises StorageError (too large, over quota, disk full, busy) with a sentence for the user.

        `source` names where it came from, so the same attachment is not copied again next turn."""
        async with self.session.lock(timeout=self._service.lock_timeout_s, waiting=waiting):
            self._branch_notes.extend(await self._service.branches.ensure(self, changing=True))
            return await self.session.files.write_new(name, data, source=source)

    async def refuse_upload(self, source: str, why: str) -> bool:
        """An attachment that could not be taken: it is not tried (nor its refusal said) again.
        Returns whether to say it. On a full disk even that cannot be written: then it is tried again
        at the next message, and said again only for a new reason."""
        try:
            await self.session.files.refuse_import(source)
        except StorageError:
            return self._service.remember_refusal(self.session, source, why)
        return True

    async def clear_files(self, *, waiting: Waiting | None = None) -> str:
        """Empty this chat's folder at the user's request; returns the sentence for the answer."""
        try:
            async with self.session.lock(timeout=self._service.lock_timeout_s, waiting=waiting):
                await self._service.branches.ensure(self, changing=True)
                gone = await self.session.files.clear()
        except StorageBusy:
            return (
                "This chat's files were not deleted: the chat is busy with a step that is still running. "
                f"Send {CLEAR_FILES_COMMAND} again when it has finished."
            )
        except DiskFull:
            return (
                "Deleted every file in this chat's /mnt/data and the download copies linked in its "
                "earlier answers, but the disk is still full, so the file list is brought up to date at "
                "the next step that has room."
            )
        return (
            f"Deleted every file in this chat's /mnt/data ({gone.files} files, {human_bytes(gone.bytes)}), "
            "and the download copies linked in its earlier answers."
        )

    async def resolve(self, path: str) -> Target | None:
        """Publish a file for the browser, or None when it is not a regular file of this session.
        The text names it: it counts as shown."""
        found = await self._publish(path)
        if found is None:
            return None
        link, target = found
        self._shown.setdefault(link.path, None)
        return target

    async def _resolve_inline(self, path: str) -> Target | None:
        """`resolve`, for text where an image is shown inline (the streamed answer, figures)."""
        target = await self.resolve(path)
        if target is not None and target.is_image:
            self._inline.add(target.url)
        return target

    async def _publish(self, path: str) -> tuple[Link, Target] | None:
        try:
            # Under the lock: another message of this chat may be running code that rewrites the file.
            async with self.session.lock(timeout=self._service.lock_timeout_s):
                link = await self.session.publish(path)
        except (FileMissing, InvalidPath):
            return None
        except StorageError as error:
            log.warning("could not publish %r: %s", path, error)
            self._unlinked[path] = str(error)
            return None
        target = Target(url=link.url, name=posixpath.basename(path), is_image=link.is_image)
        self._published.setdefault(target, None)
        self._links.setdefault(link.ref, link)
        return link, target

    async def rewrite(self, text: str, *, inline_images: bool = True) -> str:
        big = len(text) > SCAN_ON_LOOP_CHARS  # scanned in a thread (see SCAN_ON_LOOP_CHARS)
        references = await asyncio.to_thread(References, text) if big else References(text)
        resolve = self._resolve_inline if inline_images else self.resolve
        targets = await resolve_all(references.paths, resolve)
        if big:
            return await asyncio.to_thread(references.rewrite, targets, inline_images=inline_images)
        return references.rewrite(targets, inline_images=inline_images)

    def streaming_rewriter(self) -> StreamingRewriter:
        return StreamingRewriter(self._resolve_inline)  # the answer itself: images are shown inline

    async def sandbox_view(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Earlier answers as the model should read them: our links turned back into /mnt/data paths.

        The chat history holds the answers as the user saw them, with /cache/... URLs; a model that
        reads those would start writing URLs instead of paths (and link nothing next time)."""
        if not any(m.get("role") == "assistant" for m in messages):
            return messages  # a chat's first message: no earlier answers, no query
        links = await self.session.links()
        if not links:
            return messages
        paths = {link.url: f"/mnt/data/{link.path}" for link in links}
        pattern = re.compile("|".join(re.escape(url) for url in sorted(paths, key=len, reverse=True)))
        view = []
        for message in messages:
            content = message.get("content")
            if message.get("role") == "assistant" and isinstance(content, str) and pattern.search(content):
                message = {**message, "content": pattern.sub(lambda m: paths[m.group()], content)}
            view.append(message)
        return view


def _is_picture(path: str) -> bool:
    return path.lower().endswith((".png", ".jpg", ".jpeg", ".svg"))


def _kernel_key(user_key: str, chat_key: str) -> str:
    # The folder's keys: the same for every worker, and what the storage deletes sessions by.
    return f"{user_key}/{chat_key}"


def _tighter(configured: int | None, budget: int | None) -> int | None:
    """The runner's limit, lowered to what the quota still allows (None on either side: no bound
    from it). Never below 1 byte: a run with nothing left to write may still compute and print."""
    if budget is None:
        return configured
    return max(1, budget if configured is None else min(configured, budget))


class Engine:
    """The store and the runner, composed. Each message hands down its `Settings` (`chat`); a chat
    opened without runs with the constructor's. The store and the kernel pool serve every chat of
    the process and keep no message's settings: its quotas travel with its session, its limits and
    kernel settings with each run.

    With `kernels`, every chat's runs share one live Python kernel (variables persist); without,
    every run is a fresh sandbox."""

    def __init__(
        self,
        store: Store,
        runner: Runner,
        settings: Settings | None = None,
        *,
        kernels: KernelPool | None = None,
        lock_timeout_s: float = LOCK_WAIT_S,
    ) -> None:
        self.store = store
        self.runner = runner
        self.settings = settings or Settings()
        self.kernels = kernels
        self.lock_timeout_s = lock_timeout_s
        self.branches = Branches(self)
        # (user key, chat key) -> time.monotonic() of the session's last full reconcile here.
        self._full_at: dict[tuple[str, str], float] = {}
        # Attachments refused when not even the refusal could be written (a full disk), with why.
        self._refusals: dict[tuple[str, str, str], str] = {}

    def remember_refusal(self, session: Session, source: str, why: str) -> bool:
        """Note a refusal the index could not keep; False when the same one was said already."""
        key = (session.user_id, session.chat_id, source)
        if self._refusals.get(key) == why:
            return False
        if len(self._refusals) >= 10_000:
            self._refusals.clear()
        self._refusals[key] = why
        return True

    async def chat(self, user_id: str, chat_id: str, settings: Settings | None = None) -> ChatSession:
        """The chat's session, bound to the message's settings: its quotas travel with the session, its
        limits with each run. None: the constructor's limits, and the store's own quotas."""
        policy = settings.policy if settings is not None else None
        session = await self.store.session(user_id, chat_id, policy=policy, cached=True)
        return ChatSession(self, session, settings or self.settings)

    def retune(self, was: Settings, now: Settings) -> None:
        """An admin saved new valves (`was` -> `now`, one form's): the kernels whose chats last ran
        with that form's kernel settings take the new ones now (KernelPool.retune), not at their next
        message."""
        if self.kernels is not None and was.kernels != now.kernels:
            self.kernels.retune(was.kernels, now.kernels)

    async def execute(
        self, session: Session, code: str, language: str, limits: Limits, kernels: KernelSettings
    ) -> RunResult:
        """Run code in the session's folder: in its kernel (with the message's kernel settings), or
        in a fresh sandbox."""
        if self.kernels is None:
            return await self.runner.run(code, language, session.path, limits)
        key = _kernel_key(session.user_key, session.chat_key)
        return await self.kernels.run(
            key, session.path, code, language, limits, state_dir=session.state_path, settings=kernels
        )

    async def purge(self, purge: Purge) -> CleanupReport:
        """An admin's purge: the selected sessions go, with their files, links and kernels. The
        answers' states this process is saving are saved first (a chat saving one is in use)."""
        await self.branches.settle()
        return await self._ended(await self.store.cleanup(purge), "an admin deleted this chat's files")

    async def expire(self, settings: Settings | None = None) -> CleanupReport:
        """The expiry of the settings (None: the store's own): old files and idle sessions go (an
        expired session's kernel too)."""
        report = await self.store.cleanup(policy=settings.policy if settings is not None else None)
        return await self._ended(report, "this chat was unused long enough to expire")

    async def forget_chats(self, chats: list[tuple[str, str]], reason: str) -> CleanupReport:
        """Sessions of chats that no longer exist, deleted now (a chat mid-step is left for later)."""
        await self.branches.settle()
        return await self._ended(await self.store.delete_chats(chats, reason), None)

    async def _ended(self, report: CleanupReport, said: str | None) -> CleanupReport:
        """Stop the kernels of the sessions a cleanup removed. `said`: why, for the chat's next run;
        None: the chat is gone for good, so nothing is kept for it."""
        if self.kernels is not None:
            for item in report.details:
                if item.action in ("removed", "vanished"):
                    key = _kernel_key(item.user_key, item.chat_key)
                    # The store removed the session's saved state with it; one written since (the
                    # kernel was being saved as the session went) goes here.
                    state = self.store.saved_state_path(item.user_key, item.chat_key)
                    await self.kernels.stop(key, said or item.reason, forget=said is None, state_dir=state)
        return report

    async def close(self) -> None:
        """Stop this process's kernels and close the store (the answers' states being saved first)."""
        await self.branches.settle()
        if self.kernels is not None:
            await self.kernels.close()
        await self.store.close()

    async def reconcile_after(self, session: Session, result: RunResult | None) -> ReconcileReport:
        """Index what a run left in the session's folder (`result` None: the runner failed before it
        could say), quotas enforced. The caller holds the session's lock."""
        report = await session.reconcile(enforce_quotas=True, changed=self._changed_hint(session, result))
        self._reconciled(session, report)
        return report

    def _changed_hint(self, session: Session, result: RunResult | None) -> tuple[str, ...] | None:
        """The paths to reconcile, or None for a full listing: when the runner failed or does not
        know what changed, and at the first step of a session here and every FULL_RECONCILE_EVERY_S."""
        if result is None or result.changed is None or result.outcome == Outcome.SANDBOX_FAILURE:
            return None
        last = self._full_at.get((session.user_key, session.chat_key))
        if last is None or time.monotonic() - last >= FULL_RECONCILE_EVERY_S:
            return None
        return result.changed

    def _reconciled(self, session: Session, report: ReconcileReport) -> None:
        """Note when the session's folder was last listed whole."""
        if not report.full:
            return
        now = time.monotonic()
        if len(self._full_at) >= 10_000:  # forget sessions that will be listed fully anyway
            self._full_at = {k: t for k, t in self._full_at.items() if now - t < FULL_RECONCILE_EVERY_S}
        self._full_at[(session.user_key, session.chat_key)] = now
