"""The books of per-namespace device memory, on CPU: the daemon's (kvtier.mechanism.device_book:
holders, allocations, exports, the namespaces' table files) and a client's plan
(kvtier_client.device_plan), driven together by a state machine against a model of what
each allocation holds. The CUDA calls that carry the books out run on a GPU
(tests/mechanism/test_device_isolation_gpu.py).

The model: every allocation (by generation) remembers which namespaces' bytes it has held
since it was last zeroed. The daemon writes a slot's holder's bytes (a promotion); a
client maps what its plan fetches; a hostile client asks for any slots at all. After every
step: no client of a namespace maps, or could ever be handed, an allocation holding another
namespace's bytes, and an exported allocation never backs another namespace's slot.
"""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.mechanism.device_book import DeviceBook, NamespaceTables
from kvtier_client.device_plan import MAX_SLOTS_PER_REQUEST, TABLE_HEADER, SlotMappings, table_bytes

PAGES = 6
NAMESPACES = ("a", "b", "c")
slots = st.integers(0, PAGES - 1)
namespaces = st.sampled_from(NAMESPACES)


class Client:
    """One namespace's client process: its table (mapped read-only, as a client maps it) and
    what it maps."""

    def __init__(self, tables: NamespaceTables, namespace: str, pages: int = PAGES) -> None:
        fd = os.dup(tables.fd(namespace))  # what the handoff hands over: another descriptor of the file
        try:
            self.mm = mmap.mmap(fd, table_bytes(pages), mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.table = np.frombuffer(self.mm, dtype=np.uint64)
        self.mappings = SlotMappings(pages)
        self.received: set[int] = set()  # every generation this namespace's processes were handed


class DeviceBooks(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = DeviceBook(PAGES)
        self.tables = NamespaceTables("kvtier-test", self.book)
        self.clients: dict[str, Client] = {}
        self.held_bytes: dict[int, set[str]] = {}  # generation -> namespaces whose bytes it holds
        self.zeroed = 0

    def teardown(self) -> None:
        for client in self.clients.values():
            del client.table
            client.mm.close()
        self.tables.close()

    # -- the daemon -------------------------------------------------------------
    @rule(slot=slots, namespace=namespaces)
    def give(self, slot, namespace):
        """What DeviceArena.give does: plan, new memory where the old left the daemon, apply,
        tables, zero."""
        handover = self.book.plan(slot, namespace)
        if handover is None:
            assert self.book.holder[slot] == namespace
            return
        old = self.book.allocation[slot]
        assert handover.fresh == old.exported
        allocation = self.book.apply(handover)
        self.tables.handed_over(handover, allocation)
        assert (allocation.generation != old.generation) == handover.fresh
        self.held_bytes[allocation.generation] = set()  # zeroed (kept or fresh)
        self.zeroed += 1

    @rule(slot=slots)
    def promote(self, slot):
        """The daemon's copy engine writes the holder's page into the slot."""
        holder = self.book.holder[slot]
        if holder is not None:
            self.held_bytes.setdefault(self.book.allocation[slot].generation, set()).add(holder)

    # -- clients ----------------------------------------------------------------
    @rule(namespace=namespaces)
    def attach(self, namespace):
        if namespace not in self.clients:
            self.clients[namespace] = Client(self.tables, namespace)

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def sync(self, data):
        """A client does what its plan says: drop, then fetch in batches."""
        namespace = data.draw(st.sampled_from(sorted(self.clients)))
        client = self.clients[namespace]
        plan = client.mappings.plan(client.table)
        for slot in plan.drop:
            client.mappings.dropped(slot)
        for batch in plan.batches():
            assert len(batch) <= MAX_SLOTS_PER_REQUEST
            for slot, allocation in self.book.export(namespace, batch):
                client.received.add(allocation.generation)
                client.mappings.mapped(slot, allocation.generation)
        # Matched: it maps exactly what its namespace holds, at the current generations.
        held = self.book.held(namespace)
        assert client.mappings.held() == held
        assert all(client.mappings.current(client.table, s) for s in held)

    @precondition(lambda self: self.clients)
    @rule(data=st.data(), asked=st.lists(st.integers(-2, PAGES + 2), max_size=10))
    def hostile_fetch(self, data, asked):
        """A client asks for any slots, its namespace's or not, out of range or twice."""
        namespace = data.draw(st.sampled_from(sorted(self.clients)))
        granted = self.book.export(namespace, asked)
        assert [s for s, _ in granted] == [s for s in dict.fromkeys(asked) if 0 <= s < PAGES
                                             and self.book.holder[s] == namespace]
        self.clients[namespace].received.update(a.generation for _, a in granted)

    # -- what must hold ---------------------------------------------------------
    @invariant()
    def no_namespace_is_handed_anothers_bytes(self):
        for namespace, client in self.clients.items():
            for generation in client.received:
                assert self.held_bytes.get(generation, set()) <= {namespace}, (namespace, generation)

    @invariant()
    def exported_memory_never_backs_another_namespace(self):
        for namespace, client in self.clients.items():
            for slot, allocation in enumerate(self.book.allocation):
                if allocation.generation in client.received:
                    assert self.book.holder[slot] == namespace

    @invariant()
    def tables_name_exactly_the_holdings(self):
        for namespace, client in self.clients.items():
            expected = [self.book.allocation[s].generation if self.book.holder[s] == namespace else 0
                        for s in range(PAGES)]
            assert client.table[TABLE_HEADER:].tolist() == expected


TestDeviceBooks = DeviceBooks.TestCase
TestDeviceBooks.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_slot_whose_memory_never_left_the_daemon_keeps_it_and_one_that_did_gets_new():
    book = DeviceBook(2)
    first = book.allocation[0].generation
    assert book.apply(book.plan(0, "a")).generation == first  # never exported: kept (zeroed)
    assert book.apply(book.plan(0, "b")).generation == first
    [(slot, exported)] = book.export("b", [0, 1])  # slot 1 is nobody's: not handed out
    assert slot == 0 and exported.exported
    handover = book.plan(0, "a")
    assert handover.fresh
    assert book.apply(handover).generation not in (first, book.allocation[1].generation)
    assert book.plan(0, "a") is None  # already held


def test_apply_refuses_a_plan_the_books_moved_past():
    book = DeviceBook(1)
    stale = book.plan(0, "a")
    book.apply(book.plan(0, "b"))
    with pytest.raises(RuntimeError, match="changed holder"):
        book.apply(stale)


def test_the_taken_count_tells_a_client_to_drop_what_it_lost():
    book = DeviceBook(3)
    tables = NamespaceTables("kvtier-test", book)
    try:
        for slot in (0, 1):
            tables.handed_over(h := book.plan(slot, "a"), book.apply(h))
        client = Client(tables, "a", 3)
        mappings = client.mappings
        plan = mappings.plan(client.table)
        assert plan.drop == [] and plan.fetch == [0, 1]
        for slot, allocation in book.export("a", plan.fetch):
            mappings.mapped(slot, allocation.generation)
        assert mappings.current(client.table, 0) and mappings.current(client.table, 1)
        tables.handed_over(h := book.plan(1, "b"), book.apply(h))
        # Slot 0 is still a's, but the count moved: the hot path asks for a plan, which drops 1.
        assert not mappings.current(client.table, 0)
        plan = mappings.plan(client.table)
        assert plan.drop == [1] and plan.fetch == []
        mappings.dropped(1)
        assert mappings.current(client.table, 0) and mappings.held() == [0]
        del client.table
        client.mm.close()
    finally:
        tables.close()


def test_a_client_cannot_write_its_table():
    book = DeviceBook(2)
    tables = NamespaceTables("kvtier-test", book)
    try:
        fd = tables.fd("a")
        with pytest.raises(PermissionError):  # F_SEAL_FUTURE_WRITE: no writable shared mapping
            mmap.mmap(fd, table_bytes(2), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\xff" * 8, 8)
        with pytest.raises(PermissionError):  # sealed against shrinking and growing
            os.ftruncate(fd, 8)
    finally:
        tables.close()


def test_a_table_made_late_is_built_from_the_books():
    book = DeviceBook(3)
    tables = NamespaceTables("kvtier-test", book)
    try:
        tables.handed_over(h := book.plan(2, "a"), book.apply(h))  # no table of a's yet
        client = Client(tables, "a", 3)
        assert client.table[TABLE_HEADER:].tolist() == [0, 0, book.allocation[2].generation]
        del client.table
        client.mm.close()
    finally:
        tables.close()


def test_fetch_batches_fit_one_descriptor_message():
    mappings = SlotMappings(600)
    table = np.zeros(table_bytes(600) // 8, dtype=np.uint64)
    table[TABLE_HEADER:] = np.arange(1, 601)
    batches = mappings.plan(table).batches()
    assert [len(b) for b in batches] == [MAX_SLOTS_PER_REQUEST, MAX_SLOTS_PER_REQUEST, 600 - 2 * MAX_SLOTS_PER_REQUEST]
    assert sum(batches, []) == list(range(600))
    with pytest.raises(ValueError, match="generation 0"):
        mappings.mapped(0, 0)
