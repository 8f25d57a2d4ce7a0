"""A Redis (or Valkey) Cluster on loopback, for the cluster tier's tests and `kvtier bench cluster`.

`LocalRedisCluster.start(workdir)` runs every node as its own `redis-server` process on free
127.0.0.1 ports (client port and cluster-bus port both chosen here, so nothing collides with
another cluster on the machine), cluster mode on, no persistence, each node with its own
directory and log under `workdir`. Slots are assigned and nodes introduced with plain cluster
commands through redis-py (ADDSLOTSRANGE, SET-CONFIG-EPOCH, MEET, REPLICATE: what `redis-cli
--cluster create` sends), so only the server binary is needed; `start` returns once every node
reports cluster_state:ok and all agree on who owns which slot.

The fault operations are what a test of a client needs to see for real: `kill` (SIGKILL),
`restart`, `failover` (manual, FORCE or TAKEOVER), `reshard` (slots moved live, key by key, so
a client meets ASK and MOVED replies), `set_maxmemory` (eviction). Needs Redis >= 7.0 or Valkey
(for `cluster-port` and CLUSTER ADDSLOTSRANGE); scripts/setup_redis.sh installs Debian's.
With `tls`, every node speaks TLS only, to clients and on the cluster bus (Debian's build has
TLS), and `url` is a rediss:// address.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from kvtier_bench.peers.redis import redis_server_binary
from kvtier_bench.services import Service, ServiceError, free_port, tail

SLOTS = 16384
#: How long a node may be unreachable before the others mark it failed (and its replica takes
#: over). Short, so that failover tests take seconds; long enough not to trip on a busy 2-core
#: machine.
NODE_TIMEOUT_MS = 2000
FAILOVER_MODES = {"default": (), "force": ("FORCE",), "takeover": ("TAKEOVER",)}
SETUP_HINT = "install redis-server (scripts/setup_redis.sh as root, or apt-get install redis-server)"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS cluster: the nodes' certificate and key, and the CA that signed it
    (clients verify the nodes with it; clients present no certificate)."""

    cert: Path
    key: Path
    ca: Path

    def client_options(self) -> dict:
        return {"ssl": True, "ssl_ca_certs": str(self.ca)}


class Node:
    """One redis-server of the cluster. `port` and `node_id` stay the same across restarts
    (the id lives in the node's nodes.conf); `pid` is the current process's."""

    def __init__(self, index: int, port: int, bus_port: int, directory: Path, tls: TlsFiles | None = None) -> None:
        self.index = index
        self.port = port
        self.bus_port = bus_port
        self.dir = directory
        self.node_id = ""
        self.service: Service | None = None
        self.starts = 0
        # Bytes in and out: keys may be binary. Reconnects by itself after a restart.
        self.admin = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10, socket_connect_timeout=2,
                                 **(tls.client_options() if tls else {}))
        # redis-py decodes these keys to str (replacing bytes that are not UTF-8): keep them as they are.
        self.admin.set_response_callback("CLUSTER GETKEYSINSLOT", lambda keys, **options: keys)

    @property
    def pid(self) -> int | None:
        return self.service.proc.pid if self.service is not None else None

    @property
    def alive(self) -> bool:
        return self.service is not None and self.service.proc.poll() is None

    @property
    def role(self) -> str:
        """"master", "replica" or "down", as the node itself says now (roles change on failover)."""
        if not self.alive:
            return "down"
        return "master" if self.admin.execute_command("ROLE")[0] == b"master" else "replica"

    def master_port(self) -> int | None:
        """For a replica, the port of the master it replicates (None for a master)."""
        role = self.admin.execute_command("ROLE")
        return int(role[2]) if role[0] == b"slave" else None

    def info(self, section: str) -> dict:
        return self.admin.info(section)

    def __repr__(self) -> str:
        return f"<redis node 127.0.0.1:{self.port} pid {self.pid} {'up' if self.alive else 'down'}>"


class LocalRedisCluster:
    """A running loopback cluster; build it with `start`, end it with `stop` (or a `with` block)."""

    def __init__(self, workdir: Path, binary: str, nodes: list[Node], maxmemory: int | None,
                 tls: TlsFiles | None = None) -> None:
        self.workdir = workdir
        self.binary = binary
        self.nodes = nodes
        self.maxmemory = maxmemory
        self.tls = tls

    # -- building it ------------------------------------------------------------------
    @classmethod
    def start(cls, workdir: str | os.PathLike, masters: int = 3, replicas: int = 0, maxmemory: int | None = None, *,
              binary: str | None = None, timeout: float = 60.0, tls: TlsFiles | None = None) -> LocalRedisCluster:
        """`masters` nodes sharing the 16,384 slots evenly, each with `replicas` replicas (per
        master, as redis-cli's --cluster-replicas); `maxmemory` bytes per node (allkeys-lru)
        if given. Raises ServiceError, with the node's log tail, when a node cannot start or the
        cluster does not form within `timeout` seconds."""
        if masters < 1 or replicas < 0:
            raise ValueError(f"need at least one master and no negative replica count, got {masters} and {replicas}")
        binary = binary or redis_server_binary()
        if binary is None:
            raise ServiceError(f"no redis-server or valkey-server found: {SETUP_HINT}")
        workdir = Path(workdir)
        count = masters * (1 + replicas)
        ports: list[int] = []
        while len(ports) < 2 * count:  # a client port and a bus port per node, all distinct
            port = free_port()
            if port not in ports:
                ports.append(port)
        nodes = []
        for i in range(count):
            directory = workdir / f"node-{ports[2 * i]}"
            directory.mkdir(parents=True, exist_ok=True)
            nodes.append(Node(i, ports[2 * i], ports[2 * i + 1], directory, tls))
        cluster = cls(workdir, binary, nodes, maxmemory, tls)
        try:
            for node in nodes:
                cluster._launch(node)
            for node in nodes:
                node.service.wait_port(node.port, timeout)
                node.node_id = node.admin.execute_command("CLUSTER MYID").decode()
            cluster._form(masters, timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _launch(self, node: Node) -> None:
        if self.tls is None:
            listen = ["--port", str(node.port)]
        else:
            listen = ["--port", "0", "--tls-port", str(node.port), "--tls-cert-file", str(self.tls.cert),
                      "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                      "--tls-auth-clients", "no", "--tls-cluster", "yes", "--tls-replication", "yes"]
        argv = [self.binary, *listen, "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-port", str(node.bus_port), "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
                "--dir", str(node.dir), "--daemonize", "no",
                "--repl-diskless-sync-delay", "0"]  # a replica syncs at once, not after 5 s
        if self.maxmemory is not None:
            argv += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        node.starts += 1
        log = node.dir / ("redis.log" if node.starts == 1 else f"redis.{node.starts}.log")  # keep earlier logs
        node.service = Service(f"redis-server 127.0.0.1:{node.port}", argv, log)

    def _form(self, masters: int, timeout: float) -> None:
        """Slots to the first `masters` nodes, every node introduced to the first, then each
        other node made a replica of master i % masters (what `redis-cli --cluster create` does)."""
        heads = self.nodes[:masters]
        bounds = [SLOTS * i // masters for i in range(masters + 1)]
        for epoch, node in enumerate(self.nodes, 1):
            node.admin.execute_command("CLUSTER SET-CONFIG-EPOCH", epoch)  # distinct: no epoch collisions to settle
        for node, start, end in zip(heads, bounds, bounds[1:]):
            node.admin.execute_command("CLUSTER ADDSLOTSRANGE", start, end - 1)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            first.admin.execute_command("CLUSTER MEET", "127.0.0.1", node.port, node.bus_port)
        self._wait(lambda: all(self._knows_everyone(n) for n in self.nodes), timeout, "introduced to each other")
        for node in self.nodes[masters:]:
            node.admin.execute_command("CLUSTER REPLICATE", heads[node.index % masters].node_id)
        self.wait_ok(timeout)

    def _knows_everyone(self, node: Node) -> bool:
        known = node.admin.execute_command("CLUSTER NODES")
        return len(known) == len(self.nodes) and not any("handshake" in n["flags"] for n in known.values())

    # -- what it looks like -----------------------------------------------------------
    @property
    def url(self) -> str:
        """Every node's address, as the cluster tier takes it: "redis://127.0.0.1:p1,127.0.0.1:p2,..."."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def client(self, **kwargs) -> RedisCluster:
        """A redis-py cluster client on the live nodes (close it when done)."""
        options = {**(self.tls.client_options() if self.tls else {}), **kwargs}
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in self.nodes if n.alive], **options)

    def masters(self) -> list[Node]:
        """Live nodes that are masters now."""
        return [n for n in self.nodes if n.role == "master"]

    def replicas(self) -> list[Node]:
        """Live nodes that are replicas now."""
        return [n for n in self.nodes if n.role == "replica"]

    def replicas_of(self, master: Node) -> list[Node]:
        return [n for n in self.replicas() if n.master_port() == master.port]

    def slot_map(self, node: Node) -> dict[tuple[int, int], int]:
        """(first slot, last slot) -> port of the master serving it, as `node` sees it."""
        return {(int(r[0]), int(r[1])): int(r[2][1]) for r in node.admin.execute_command("CLUSTER SLOTS")}

    def slots_of(self, master: Node) -> list[int]:
        """The slots `master` serves, as it sees it."""
        return [slot for (first, last), port in self.slot_map(master).items() if port == master.port
                for slot in range(first, last + 1)]

    def state(self) -> str:
        """Each node's view, one line per node: for error messages."""
        lines = []
        for n in self.nodes:
            if not n.alive:
                lines.append(f"  127.0.0.1:{n.port}: down")
                continue
            try:
                info = n.admin.execute_command("CLUSTER INFO")
                lines.append(f"  127.0.0.1:{n.port} ({n.role}): cluster_state:{info['cluster_state']}, "
                             f"{info['cluster_slots_ok']} slots ok, {info['cluster_known_nodes']} nodes known")
            except redis.RedisError as exc:
                lines.append(f"  127.0.0.1:{n.port}: {exc}")
        return "\n".join(lines)

    def topology(self, node: Node) -> dict[str, tuple[bool, str]]:
        """node id -> (is a master, id of its master or "-") of every node `node` knows and does
        not suspect of failing."""
        known = node.admin.execute_command("CLUSTER NODES").values()
        return {n["node_id"]: ("master" in n["flags"], n["master_id"]) for n in known if "fail" not in n["flags"]}

    def is_ok(self) -> bool:
        """Every live node reports cluster_state:ok, every one maps all slots to the same live
        masters and sees the same live masters and replicas (a replica its master does not know
        as such yet cannot fail over), and every live replica's link to its master is up."""
        live = [n for n in self.nodes if n.alive]
        try:
            maps = [self.slot_map(n) for n in live]
            if any(n.admin.execute_command("CLUSTER INFO")["cluster_state"] != "ok" for n in live):
                return False
            if any(m != maps[0] for m in maps) or sum(b - a + 1 for a, b in maps[0]) != SLOTS:
                return False
            if not set(maps[0].values()) <= {n.port for n in live}:
                return False
            live_ids = {n.node_id for n in live}
            views = [{i: v for i, v in self.topology(n).items() if i in live_ids} for n in live]
            if any(set(v) != live_ids or v != views[0] for v in views):
                return False
            return all(n.info("replication").get("master_link_status") == "up" for n in live if n.role == "replica")
        except redis.RedisError:
            return False

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until `is_ok`; ServiceError with every node's view if it does not come."""
        self._wait(self.is_ok, timeout, "ok (cluster_state:ok on every live node, one slot map)")

    def _wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not self._holds(condition):
            dead = [n for n in self.nodes if n.service is not None and n.service.proc.poll() is not None
                    and n.service.proc.returncode != -signal.SIGKILL]
            if dead:
                raise ServiceError(f"redis-server 127.0.0.1:{dead[0].port} exited with status "
                                   f"{dead[0].service.proc.returncode}: {tail(dead[0].service.log) or 'no output'}")
            if time.monotonic() > deadline:
                logs = "\n".join(f"  {n.service.log}: {tail(n.service.log, 2)}" for n in self.nodes if n.service)
                raise ServiceError(f"the Redis cluster was not {what} after {timeout:.0f} s:\n{self.state()}\n"
                                   f"log tails:\n{logs}")
            time.sleep(0.05)

    @staticmethod
    def _holds(condition: Callable[[], bool]) -> bool:
        try:
            return condition()
        except redis.RedisError:  # a node still starting, or one just killed: not yet
            return False

    def flushall(self) -> None:
        """Empty every master (replicas follow)."""
        for node in self.masters():
            node.admin.flushall()

    # -- faults -------------------------------------------------------------------------
    def kill(self, node: Node) -> None:
        """SIGKILL the node's process (no shutdown, no goodbye to the others) and reap it."""
        if node.alive:
            os.kill(node.pid, signal.SIGKILL)
            node.service.proc.wait()
        node.admin.connection_pool.disconnect()

    def restart(self, node: Node, timeout: float = 60.0) -> None:
        """Start a stopped or killed node again on its port and directory (same node id, no data:
        there is no persistence); returns when the cluster is ok again. A master whose replica
        took over comes back as that replica's replica."""
        if node.alive:
            raise ValueError(f"{node} is running; kill or stop it first")
        node.admin.connection_pool.disconnect()
        self._launch(node)
        node.service.wait_port(node.port, timeout)
        self.wait_ok(timeout)

    def failover(self, replica: Node, mode: str = "default", timeout: float = 60.0) -> None:
        """CLUSTER FAILOVER on `replica` (`mode` "default": with its master's agreement, which
        must be alive; "force": without it, elected by the other masters; "takeover": no
        election at all); returns when the replica is a master and the cluster is ok."""
        if mode not in FAILOVER_MODES:
            raise ValueError(f"failover mode must be one of {', '.join(FAILOVER_MODES)}, got {mode!r}")
        if replica.role != "replica":
            raise ValueError(f"{replica} is not a replica (it is {replica.role})")
        replica.admin.execute_command("CLUSTER FAILOVER", *FAILOVER_MODES[mode])
        self._wait(lambda: replica.role == "master", timeout, f"failed over to 127.0.0.1:{replica.port}")
        self.wait_ok(timeout)

    def reshard(self, n_slots: int, src: Node, dst: Node, *, batch: int = 100,
                during: Callable[[int], None] | None = None) -> list[int]:
        """Move `src`'s first `n_slots` slots to `dst` while clients keep running, as `redis-cli
        --cluster reshard` does: per slot, IMPORTING on dst and MIGRATING on src, MIGRATE of its
        keys `batch` at a time (meanwhile src answers ASK for keys already moved), then SETSLOT
        NODE on every master (after which the old owner answers MOVED). `during(slot)` is called
        after a slot's first batch has moved and before the slot changes owner: the moment to
        look at a half-moved slot. Returns the slots moved."""
        slots = self.slots_of(src)[:n_slots]
        if len(slots) < n_slots:
            raise ValueError(f"{src} serves only {len(slots)} slots, cannot move {n_slots}")
        for slot in slots:
            dst.admin.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src.node_id)
            src.admin.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst.node_id)
            first = True
            while keys := src.admin.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
                src.admin.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 10_000, "REPLACE", "KEYS", *keys)
                if first and during is not None:
                    during(slot)
                first = False
            for node in [dst, src, *(m for m in self.masters() if m not in (src, dst))]:
                node.admin.execute_command("CLUSTER SETSLOT", slot, "NODE", dst.node_id)
        self.wait_ok()
        return slots

    def set_maxmemory(self, nbytes: int, policy: str = "allkeys-lru") -> None:
        """Cap every live node at `nbytes` (0: no cap) with eviction `policy`."""
        for node in self.nodes:
            if node.alive:
                node.admin.config_set("maxmemory", nbytes)
                node.admin.config_set("maxmemory-policy", policy)

    def info_memory(self) -> dict[int, dict]:
        """Per live node (by port): used_memory, maxmemory, maxmemory_policy and evicted_keys."""
        out = {}
        for node in self.nodes:
            if node.alive:
                memory, stats = node.info("memory"), node.info("stats")
                out[node.port] = {"used_memory": memory["used_memory"], "maxmemory": memory["maxmemory"],
                                  "maxmemory_policy": memory["maxmemory_policy"], "evicted_keys": stats["evicted_keys"]}
        return out

    # -- ending it ----------------------------------------------------------------------
    def stop(self) -> None:
        """End every node (SIGTERM, SIGKILL after 5 s), by its PID; nothing is left running.
        Safe to call twice. The node directories stay in `workdir` (the caller's)."""
        for node in self.nodes:
            if node.alive:
                node.service.proc.send_signal(signal.SIGTERM)  # all at once, then wait for each
        for node in self.nodes:
            if node.service is not None:
                node.service.stop(timeout=5)
            node.admin.close()

    def __enter__(self) -> LocalRedisCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
