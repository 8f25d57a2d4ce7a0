"""kvtier's tier changes relayed as vLLM KV events, without an engine, for
tests/integrations/test_vllm_connector.py (run with .venv-vllm's python; prints one JSON
object):

    vllm_event_checks.py --target unix:///path/kvtier.sock --daemon-pid PID --daemon-command JSON

The daemon must run with KV events on, a disk tier written through at commit and a small
host tier (16 pages of this layout). The real KVTierScheduler and KVTierWorker save prompts
into it as vLLM drives them; every batch of events the scheduler hands vLLM (`take_events`)
goes out through vLLM's own ZMQ publisher and is read back by a subscriber with vLLM's own
decoder (msgspec, KVEventBatch). Steps: (1) a prompt is saved: its BlockStored (CPU, token
ids), then the daemon's disk write: a BlockStored DISK without token ids, the same hashes;
(2) another engine fills the host tier: BlockRemoved CPU of the prompt's pages, and nothing
about the other engine's pages; (3) a second prompt, then the daemon stops (SIGTERM: its
host tier goes, BlockRemoved CPU) and starts again (this script restarts it with
--daemon-command): the relay watches again by itself, and a third prompt's disk write is
relayed; (4) a connector that follows at most 2 pages withdraws the oldest; (5) with KV
events off there is no relay at all; (6) a hybrid model's two groups (full attention and a
sliding window): every group's pages are told, each under its group_idx and kind, both
the commit and the disk write. Reports what was decoded, per step.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

BLOCK, LAYERS, HEADS, HEAD_DIM = 32, 2, 2, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
NAMESPACE = "checks/tier-events"
WAIT_S = 20.0


def _exited(pid: int) -> bool:
    """The daemon (another process's child) has exited: gone, or a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


class Subscriber:
    """vLLM's ZMQ publisher and a SUB socket that decodes what it sends with vLLM's decoder."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.config.kv_events import KVEventsConfig
        from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch

        self.publisher = EventPublisherFactory.create(
            KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"))
        self.batch = KVEventBatch
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(endpoint)
        self.zmq = zmq

    def ready(self) -> None:
        """Publish empty batches until the subscriber gets one (ZMQ's slow joiner)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.publisher.publish(self.batch(ts=time.time(), events=[]))
            if self.sub.poll(200):
                self.sub.recv_multipart()
                while self.sub.poll(100):
                    self.sub.recv_multipart()
                return
        raise AssertionError("vLLM's publisher never reached the subscriber")

    def relay(self, events: list) -> list:
        """Publish one step's events as vLLM's scheduler does; what the subscriber decodes."""
        if not events:
            return []
        self.publisher.publish(self.batch(ts=time.time(), events=events))
        if not self.sub.poll(int(WAIT_S * 1000)):
            raise AssertionError("a published batch never arrived")
        _topic, _seq, payload = self.sub.recv_multipart()
        return list(self.decoder.decode(payload).events)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.publisher.shutdown()


def tier_events(target: str, daemon_pid: int, daemon_command: list[str], workdir: Path) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier_client import KVTierClient, PageLayout
    from kvtier_client.integrations.vllm import ConnectorConfig, KVTierScheduler, KVTierWorker
    from kvtier_client.integrations.vllm.kv_groups import single_group
    from kvtier_client.integrations.vllm.kv_views import GroupViews
    from kvtier_client.integrations.vllm.link import DaemonLink
    from kvtier_client.integrations.vllm.shapes import WorkerSlice
    from vllm_steps import scheduler_output, worker_hooks

    layout = PageLayout(LAYERS, HEADS, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    group = single_group(layout, LAYER_NAMES)
    torch.manual_seed(0)
    kv = {name: torch.randn(64, HEADS, BLOCK, 2 * HEAD_DIM) for name in LAYER_NAMES}
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    words = iter(range(10**6))
    blocks = iter(range(10**6))
    subscriber = Subscriber(f"ipc://{workdir}/vllm-events.ipc")
    subscriber.ready()

    def engine(extra: dict, events: bool = True) -> tuple[KVTierScheduler, KVTierWorker]:
        config = ConnectorConfig.from_extra({"target": target, "namespace": NAMESPACE, "planner": False,
                                             "prefetch": False, **extra}, default_namespace="x")
        scheduler = KVTierScheduler([DaemonLink.open(config, layout, "scheduler")], [group], config, BLOCK,
                                    do_load=True, do_save=True, events=events)
        part = WorkerSlice(0, 0, HEADS, True, group.page_layers)
        worker = KVTierWorker([GroupViews(group, part, DaemonLink.open(config, layout, "worker"))], None, "cpu")
        worker.register_kv_caches(kv)
        return scheduler, worker

    def save(scheduler: KVTierScheduler, worker: KVTierWorker, rid: str, n_blocks: int) -> list:
        """A new prompt of n_blocks full blocks (and a few tokens) computed and saved in one step;
        its blocks' hashes as events carry them."""
        request = Request(rid, [next(words) % 500 for _ in range(n_blocks * BLOCK + 3)], SamplingParams(max_tokens=2),
                          None, block_hasher=hasher)
        scheduler.on_new_request(request)
        external, _ = scheduler.get_num_new_matched_tokens(request, 0)
        assert not external, f"{rid} is new, yet kvtier offered {external} tokens"
        scheduler.update_state_after_alloc(request, None, 0)
        ids = [next(blocks) % 64 for _ in range(n_blocks + 1)]
        meta = scheduler.build_connector_meta(scheduler_output(
            {rid: len(request.prompt_token_ids)}, [NewRequestData.from_request(request, (ids,))]))
        worker_hooks(worker, meta, LAYER_NAMES)
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta()))
        scheduler.request_finished(request, [])
        return [maybe_convert_block_hash(h) for h in request.block_hashes[:n_blocks]]

    decoded: list = []  # every event the subscriber decoded, in order

    def collect(scheduler: KVTierScheduler, until, wait: float = WAIT_S) -> list:
        """Take the scheduler's events every 50 ms (as vLLM's engine steps would) and publish
        them, until `until(events so far)` holds or `wait` seconds passed."""
        got: list = []
        deadline = time.monotonic() + wait
        while True:
            got += subscriber.relay(list(scheduler.take_events()))
            if until(got) or time.monotonic() > deadline:
                decoded.extend(got)
                return got
            time.sleep(0.05)

    def describe(events: list) -> list:
        return [{"type": type(e).__name__, "medium": e.medium, "blocks": len(e.block_hashes),
                 "tokens": len(e.token_ids) if isinstance(e, BlockStored) else None,
                 "ownership": e.ownership, "locality": e.locality} for e in events]

    def names(events: list, kind, medium: str) -> list:
        return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]

    out: dict = {}
    scheduler, worker = engine({})
    out["thread"] = any(t.name == "kvtier-tier-events" for t in threading.enumerate())
    deadline = time.monotonic() + WAIT_S
    while not scheduler.tier_events.watching and time.monotonic() < deadline:
        time.sleep(0.05)

    # (1) a save: the commit's BlockStored CPU, then the daemon's write-through: DISK.
    r1 = save(scheduler, worker, "r1", 3)
    got = collect(scheduler, lambda ev: set(names(ev, BlockStored, "DISK")) >= set(r1))
    stored = [e for e in got if isinstance(e, BlockStored)]
    out["save"] = {
        "events": describe(got),
        "cpu_hashes": names(got, BlockStored, "CPU") == r1,
        "cpu_tokens": [len(e.token_ids) for e in stored if e.medium == "CPU"],
        "disk_hashes": names(got, BlockStored, "DISK") == r1,
        "disk_tokens": [len(e.token_ids) for e in stored if e.medium == "DISK"],
        "disk_after_cpu": [e.medium for e in stored][:1] == ["CPU"],
    }

    # (2) another engine's 24 pages push r1 out of the 16-page host tier (its disk copy stays).
    with KVTierClient(target) as other:
        other.register(NAMESPACE, layout)
        for batch in range(3):
            with other.borrow(8) as lease:
                lease.commit(other.block_keys([batch * 1000 + i for i in range(8 * BLOCK)]))
    got = collect(scheduler, lambda ev: set(names(ev, BlockRemoved, "CPU")) >= set(r1))
    out["evicted"] = {"events": describe(got), "cpu_removed": sorted(names(got, BlockRemoved, "CPU")) == sorted(r1),
                      "followed": scheduler.tier_events.followed}

    # (3) r2 saved; the daemon stops (its host tier goes) and starts again; r3 saved.
    r2 = save(scheduler, worker, "r2", 2)
    collect(scheduler, lambda ev: set(names(ev, BlockStored, "DISK")) >= set(r2))
    os.kill(daemon_pid, signal.SIGTERM)
    got = collect(scheduler, lambda ev: set(names(ev, BlockRemoved, "CPU")) >= set(r2))
    stopped = {"events": describe(got), "cpu_removed": set(names(got, BlockRemoved, "CPU")) == set(r2)}
    deadline = time.monotonic() + WAIT_S
    while not _exited(daemon_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(workdir / "daemon-restarted.log", "wb") as log:
        daemon = subprocess.Popen(daemon_command, stdout=log, stderr=subprocess.STDOUT)
    try:
        started = time.monotonic()
        while not scheduler.tier_events.watching and time.monotonic() - started < 2 * WAIT_S:
            time.sleep(0.05)
        stopped["watching_again_s"] = round(time.monotonic() - started, 2)
        r3 = save(scheduler, worker, "r3", 2)
        got = collect(scheduler, lambda ev: set(names(ev, BlockStored, "DISK")) >= set(r3))
        stopped["after_restart"] = describe(got)
        stopped["disk_after_restart"] = names(got, BlockStored, "DISK") == r3
        out["restart"] = stopped

        # Nothing ever named a block but ours: the other engine's pages are its own to announce.
        ours = set(r1) | set(r2) | set(r3)
        out["only_ours"] = all(set(e.block_hashes) <= ours for e in decoded)
        out["ownership"] = sorted({e.ownership for e in decoded})

        # (4) a connector that follows at most 2 pages: the third page's arrival withdraws the first.
        small, small_worker = engine({"kv_events_pages": 2})
        r4 = save(small, small_worker, "r4", 3)
        got = collect(small, lambda ev: set(names(ev, BlockStored, "DISK")) >= set(r4[1:]))
        out["bounded"] = {"events": describe(got), "withdrawn": names(got, BlockRemoved, "CPU") == r4[:1],
                          "disk": names(got, BlockStored, "DISK") == r4[1:], "followed": small.tier_events.followed}

        # (6) a hybrid model: a full-attention group and a sliding-window group, each its own keys.
        # (A process may hold 2 event watches: the bounded connector's makes room for this one.)
        small.shutdown()
        small_worker.shutdown()
        from kvtier_client.groups import GroupMode
        from kvtier_client.integrations.vllm.kv_groups import KVGroup

        window_names = [f"model.layers.{LAYERS + i}.self_attn.attn" for i in range(LAYERS)]
        for name in window_names:
            kv[name] = torch.randn(64, HEADS, BLOCK, 2 * HEAD_DIM)
        sliding = KVGroup(1, GroupMode.WINDOW, -(-4096 // BLOCK), layout, tuple(window_names), tuple(range(LAYERS)),
                          HEADS, b"|kv group 1 WINDOW 4096 0", BLOCK, sliding=4096, spec_kind="sliding_window",
                          spec_window=4096)
        hybrid_config = ConnectorConfig.from_extra({"target": target, "namespace": NAMESPACE, "planner": False,
                                                    "prefetch": False}, default_namespace="x")
        hybrid = KVTierScheduler([DaemonLink.open(hybrid_config, layout, "scheduler") for _ in range(2)],
                                 [group, sliding], hybrid_config, BLOCK, do_load=True, do_save=True, events=True)
        hybrid_worker = KVTierWorker([GroupViews(g, WorkerSlice(0, 0, HEADS, True, g.page_layers),
                                                 DaemonLink.open(hybrid_config, layout, "worker"))
                                      for g in (group, sliding)], None, "cpu")
        hybrid_worker.register_kv_caches(kv)
        started = time.monotonic()
        while not hybrid.tier_events.watching and time.monotonic() - started < WAIT_S:
            time.sleep(0.05)
        request = Request("r6", [next(words) % 500 for _ in range(2 * BLOCK + 3)], SamplingParams(max_tokens=2),
                          None, block_hasher=hasher)
        hybrid.on_new_request(request)
        hybrid.get_num_new_matched_tokens(request, 0)
        hybrid.update_state_after_alloc(request, None, 0)
        ids = tuple([1 + next(blocks) % 63 for _ in range(3)] for _ in range(2))
        meta = hybrid.build_connector_meta(scheduler_output(
            {"r6": len(request.prompt_token_ids)}, [NewRequestData.from_request(request, ids)]))
        worker_hooks(hybrid_worker, meta, LAYER_NAMES + window_names)
        hybrid.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=hybrid_worker.build_connector_worker_meta()))
        hybrid.request_finished(request, [])
        r6 = [maybe_convert_block_hash(h) for h in request.block_hashes[:2]]

        def by_group(events: list, medium: str) -> dict:
            return {str(e.group_idx): [e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_hashes == r6]
                    for e in events if isinstance(e, BlockStored) and e.medium == medium}

        got = collect(hybrid, lambda ev: len(by_group(ev, "DISK")) == 2)
        out["hybrid"] = {"cpu": by_group(got, "CPU"), "disk": by_group(got, "DISK")}

        # (5) KV events off: no relay, no thread, no events.
        plain, plain_worker = engine({}, events=False)
        before = sum(t.name == "kvtier-tier-events" for t in threading.enumerate())
        save(plain, plain_worker, "r5", 1)
        out["off"] = {"relay": plain.tier_events is not None, "events": len(list(plain.take_events())),
                      "threads_added": sum(t.name == "kvtier-tier-events" for t in threading.enumerate()) - before}

        stats = scheduler.get_kv_connector_stats()
        out["dropped"] = stats.data["kv_events_dropped"] if stats else 0
        # Shutdown ends the relay's thread.
        started = time.monotonic()
        for s, w in ((scheduler, worker), (plain, plain_worker), (hybrid, hybrid_worker)):
            s.shutdown()
            w.shutdown()
        out["shutdown_s"] = round(time.monotonic() - started, 3)
        time.sleep(0.1)
        out["threads_left"] = sum(t.name == "kvtier-tier-events" for t in threading.enumerate())
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        subscriber.close()
    out["decoded"] = len(decoded)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--daemon-pid", type=int, required=True)
    parser.add_argument("--daemon-command", required=True, help="JSON list: how to start the daemon again")
    args = parser.parse_args()
    out = tier_events(args.target, args.daemon_pid, json.loads(args.daemon_command), Path.cwd())
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
