"""The background maintenance of a process's sessions: what dead workers' sandboxes left, an admin's
purge (retried while it meets chats mid-step), chats deleted in the host, and expiry.

The host's adapter wakes it (`tick`) once a minute and at a message with a purge request
(`purge_now`); every tick of every worker sweeps its own host's leftovers, and the rest is done by
one worker (of every replica) at a time, under a lock every process of the store shares.
"""

from __future__ import annotations

import logging
import time

from runner import RunnerError

from .host import Host, PurgeValve
from .purge import parse_purge
from .service import Engine
from .settings import Settings

__all__ = ["MINUTE_S", "Maintenance"]

log = logging.getLogger("code_sessions.engine")

MINUTE_S = 60.0
_PURGE_RETRY_MINUTES = 10  # a purge that keeps meeting chats mid-step gives up (and says so) after this
# A chat missing from the host this long (two looks a background tick apart) is deleted with its files.
_DELETED_AFTER_S = 50.0
_LOGGED_VALUE_CHARS = 200  # an admin's purge text is logged at most this long


class Maintenance:
    """One adapter's maintenance (a Pipe's, a Tool's or a Filter's): its purge retries are its own,
    the rest is shared out through the store (its maintenance lock and `claim`s)."""

    # How long a "minute" of maintenance lasts (the tick, the purge retries, the interval between
    # expiries is counted in them), and how long a chat must be missing from the host before its
    # files go; tests shorten both on an instance.
    minute_s: float = MINUTE_S
    deleted_after_s: float = _DELETED_AFTER_S

    def __init__(self, host: Host, valve: PurgeValve) -> None:
        self.host = host  # replaced with the adapter's (a test harness replaces that)
        self._valve = valve
        self.purge_pending: tuple[str, float, float] | None = None  # request, first and last try
        self._seen: Settings | None = None  # the settings of this adapter's previous tick

    async def tick(self, services: Engine, settings: Settings) -> None:
        """One background tick: in every worker, what a dead worker's sandboxes left; then an admin's
        purge, chats deleted in the host, and expiry when it is due, by one worker (of every
        replica) at a time, under a lock every process of the store shares (the expiry interval is
        kept in the index, so several workers expire once)."""
        # Every worker, every tick: kernel valves an admin saved since the previous tick (a kernel's
        # idle time, saved states) reach this adapter's chats' kernels within a minute, not at their
        # next message. (Quotas and max_kernels act only within a message: they travel with it.)
        seen, self._seen = self._seen, settings
        if seen is not None:
            services.retune(seen, settings)
        # What the runs of a dead worker of this host left (its sandboxes died with it; their
        # container state, bundles and cgroups did not). Only dead owners' runs.
        try:
            await services.runner.sweep_leftovers()
        except RunnerError as error:  # no usable runsc: a run says so in words; nothing to sweep
            log.debug("code-sessions: no sweep of sandbox leftovers: %s", error)
        # What a full disk put off in this worker (chats used meanwhile, which only it knows of), once
        # an admin has freed space and no step of this worker came since.
        await services.store.catch_up()
        lock = services.store.lock("maintenance")
        if not await lock.try_acquire():
            return  # another worker (or replica) is on it
        try:
            await self._run_requested_purge(services, settings)
            # Every file of every worker ticks: the look at the host's chats is shared out like expiry.
            if await services.store.claim("deleted-chats", self.minute_s * 0.9):
                await self._forget_deleted_chats(services)
            every = settings.cleanup_every_s / MINUTE_S * self.minute_s
            if await services.store.claim("expiry", every):
                report = await services.expire(settings)
                log.info("code-sessions cleanup: %s", report.summary())
        finally:
            await lock.release()

    async def purge_now(self, services: Engine, settings: Settings) -> None:
        """At a message whose settings ask for a purge: run it now, not a minute later."""
        lock = services.store.lock("maintenance")
        if not await lock.try_acquire():
            return  # another worker is doing maintenance: it runs the purge
        try:
            await self._run_requested_purge(services, settings)
        finally:
            await lock.release()

    async def _forget_deleted_chats(self, services: Engine) -> None:
        """Delete the folders, links (and kernels) of chats deleted in the host: a Pipe hears of no
        deletion, so every tick asks, in one batched query, which of our chats still exist.

        A chat counts as deleted only when two looks at least `deleted_after_s` apart both miss it:
        a chat being created in the meantime (or a database answer that was briefly wrong) never
        loses its folder."""
        # Temporary chats and channels have no chat row in the host: they expire by idle time instead.
        saved = [
            (user, chat)
            for user, chat, _, temporary in await services.store.chats()
            if not temporary and self.host.saves_chat(chat)
        ]
        if not saved:
            return
        owners = await self.host.chat_owners(sorted({chat for _, chat in saved}))
        missing = [(user, chat) for user, chat in saved if owners.get(chat) != user]
        gone = await services.store.mark_missing(missing, after_s=self.deleted_after_s)
        if gone:
            report = await services.forget_chats(gone, "the chat was deleted in Open WebUI")
            log.info("code-sessions: %d chats deleted in Open WebUI: %s", len(gone), report.summary())

    async def _run_requested_purge(self, services: Engine, settings: Settings) -> None:
        """Run the purge the settings ask for, as saved now (call it holding the maintenance lock)."""
        saved = await self._valve.saved_purge()
        request = (settings.purge if saved is None else saved).strip()
        if not request:
            return
        shown = _shorten(request)
        try:
            purge = parse_purge(request)
        except ValueError as error:
            log.error("code-sessions: ignoring purge valve %r: %s", shown, _shorten(str(error)))
        else:
            now = time.monotonic()
            pending = self.purge_pending
            if pending and pending[0] != request:
                pending = None  # the admin typed a new request: it starts afresh
            if pending and now - pending[2] < self.minute_s:
                return  # a request that met a chat mid-step is retried once a minute, not per message
            report = await services.purge(purge)
            first_try = pending[1] if pending else now
            if report.sessions_in_use and now - first_try < _PURGE_RETRY_MINUTES * self.minute_s:
                # A chat mid-step was skipped; its step ends within the time limit, so keep the
                # request and let the next minute finish the job.
                self.purge_pending = (request, first_try, now)
                log.warning("code-sessions purge %r: %s; retrying within a minute", shown, report.summary())
                return
            log.warning("code-sessions purge %r: %s", shown, report.summary())
        self.purge_pending = None
        # Clear the one-shot request so the purge does not run again at the next message.
        await self._valve.clear_purge(request)


def _shorten(text: str, limit: int = _LOGGED_VALUE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
