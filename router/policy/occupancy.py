"""The fewest sequences, and a floor under the KV room, among a model's
workers with a free slot: what lets placement prove in O(1) that a head
fits nowhere (router/policy/placement.py, ``held_back``).

Why: with a long queue behind a full fleet, the heads of the lower classes
are blocked by class headroom on every worker (each holds the class's cap of
sequences) at most passes, yet placement sampled candidates for each of them
every time (``bench.scenarios.placement``, 100,000 queued behind 1,024
workers: one placement of the three a pass made).

Counts of the free workers per sequence count and per KV-room bucket
(``room.bit_length()``: a power-of-two floor, coarse but O(1)), each worker's
counted values kept on it (``occ_seqs``, ``occ_room``; -1: not counted).
Every change to a worker's sequences, KV held, health or other routers'
share calls ``changed``: O(1).  The lowest non-empty bucket is found from a
pointer that only moves up past empty buckets and drops on an insert below
it (amortised O(1); a lazy heap cost more per change than it saved)."""

from __future__ import annotations

from router.policy.records import WorkerState


class Occupancy:
    __slots__ = ("seqs", "rooms", "low_seqs", "low_room")

    def __init__(self) -> None:
        self.seqs: list[int] = [0] * 8  # free workers holding n sequences, by n
        self.rooms: list[int] = [0] * 8  # free workers by room.bit_length()
        self.low_seqs = 0  # every bucket below is empty
        self.low_room = 0

    def changed(self, w: WorkerState) -> None:
        """``w``'s sequences, KV held, health or other routers' share may have
        changed, or it entered or left its model's free sets: recount it."""
        if w.free_at >= 0:
            n = len(w.running) + w.other_seqs
            b = max(0, w.budget - w.reserved - w.other_tokens).bit_length()
        else:
            n = b = -1
        old = w.occ_seqs
        if n != old:
            seqs = self.seqs
            if old >= 0:
                seqs[old] -= 1
            if n >= 0:
                if n >= len(seqs):
                    seqs.extend([0] * (n + 1 - len(seqs)))
                seqs[n] += 1
                if n < self.low_seqs:
                    self.low_seqs = n
            w.occ_seqs = n
        old = w.occ_room
        if b != old:
            rooms = self.rooms
            if old >= 0:
                rooms[old] -= 1
            if b >= 0:
                if b >= len(rooms):
                    rooms.extend([0] * (b + 1 - len(rooms)))
                rooms[b] += 1
                if b < self.low_room:
                    self.low_room = b
            w.occ_room = b

    def min_seqs(self) -> int | None:
        """The fewest sequences a worker with a free slot holds (None: none has one)."""
        seqs, i = self.seqs, self.low_seqs
        while i < len(seqs) and seqs[i] == 0:
            i += 1
        self.low_seqs = i
        return i if i < len(seqs) else None

    def room_floor(self) -> int | None:
        """At most the least KV room a worker with a free slot has (None: none has one)."""
        rooms, i = self.rooms, self.low_room
        while i < len(rooms) and rooms[i] == 0:
            i += 1
        self.low_room = i
        if i >= len(rooms):
            return None
        return 0 if i == 0 else 1 << (i - 1)
