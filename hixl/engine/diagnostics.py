"""A snapshot of an engine's internals, for monitoring and tests."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Diagnostics"]


@dataclass(frozen=True, slots=True)
class Diagnostics:
    """A snapshot of an engine's internals, for monitoring and tests.

    ``progress_thread_id`` is the native id of the progress thread and
    ``progress_alive`` whether it runs; ``completion_events`` tells whether it sleeps
    on completion channels (True) or polls the CQs; ``pending_transfers`` counts
    transfers not finished yet; ``handshakes`` counts incoming handshakes under way and
    ``refused_busy`` the sockets answered ERROR(BUSY) so far; ``notifications`` counts
    notifications received and not taken yet.  ``send_posts`` counts the
    ``post_send`` calls made for transfers and notifications so far and
    ``posted_wrs`` the work requests they carried: many ``put_async`` calls issued
    while earlier ones are out go in one post (see :meth:`Engine.transfer_async`).
    ``direct_posts`` counts the blocking single requests among them that were posted
    and completed on the caller's thread (see :meth:`Engine.put`), and ``lane_posts``
    those of them that ran on a connection's direct lane.  ``slot_messages`` counts the
    asynchronous single requests written into a lane's ring of slots (see
    :meth:`Engine.put_async`); the messages queued together in one ring count as one
    pending transfer until they complete.  ``chains_built`` counts the work-request
    chains allocated for a transfer's plan (not a single message's) and
    ``chains_refilled`` the transfers of a new layout that took an idle chain of the
    same size from an earlier transfer and filled it anew instead (a repeated layout
    reuses its own chain and counts in neither).
    """

    progress_thread_id: int | None
    progress_alive: bool
    completion_events: bool
    pending_transfers: int
    peers: int
    regions: int
    handshakes: int = 0
    refused_busy: int = 0
    notifications: int = 0
    notifications_dropped: int = 0
    send_posts: int = 0
    posted_wrs: int = 0
    direct_posts: int = 0
    lane_posts: int = 0
    slot_messages: int = 0
    chains_built: int = 0
    chains_refilled: int = 0
