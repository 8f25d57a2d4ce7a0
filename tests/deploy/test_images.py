"""The container images (deploy/images/): static checks of the Dockerfiles, .dockerignore and
scripts/build_images.sh that always run, and a real build of the CPU image with a client on
the host doing a round trip through the socket directory it shares with the container.

The real tests build for minutes, so they run only with KVTIER_TEST_IMAGES=1 and a working
engine (docker with a daemon, or podman; the pod test podman only). BASE_IMAGE picks the CPU
image's base where debian:bookworm-slim cannot be pulled (e.g. a local debootstrap import,
see deploy/images/README.md); KVTIER_ENGINE picks the engine.

The pod test is warm restart as Kubernetes runs it: a pod with the arena keeper in a
container of its own (`kvtier keeper`) next to the daemon's, sharing the keeper's socket
volume; a client on the host writes pages, the daemon container is killed and a new one
started in the pod: every page is still a hit with its bytes. The same without the keeper
container (the daemon spawns its keeper inside its own container, which the kill ends) is
the baseline: every page a miss. It prints pages kept / written and the seconds from each
new container's start to SERVING.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "deploy" / "images"
DOCKERFILES = {"cpu": IMAGES / "Dockerfile", "cuda": IMAGES / "Dockerfile.cuda"}
BUILD_SCRIPT = ROOT / "scripts" / "build_images.sh"
KVTIER_GID = 2000


# -- a small Dockerfile reader ------------------------------------------------------------
@dataclass
class Instruction:
    name: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the logical line, continuations joined
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions if i.name == name]


def read_dockerfile(path: Path) -> tuple[list[Instruction], list[Stage]]:
    """Instructions before the first FROM (global ARGs) and the stages."""
    logical: list[Instruction] = []
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):  # comments inside a continued instruction
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        name, _, args = buf.partition(" ")
        logical.append(Instruction(name.upper(), args.strip(), start))
        buf = ""
    assert not buf, f"{path}: the last instruction ends with a continuation"
    head: list[Instruction] = []
    stages: list[Stage] = []
    for ins in logical:
        if ins.name == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            head.append(ins)
    return head, stages


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def copy_parts(ins: Instruction) -> tuple[dict[str, str], list[str], str]:
    """COPY's --flags, sources and destination (shell form only, as the Dockerfiles use)."""
    words = ins.args.split()
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    assert len(words) >= 2, f"line {ins.line}: COPY needs a source and a destination"
    return flags, words[:-1], words[-1]


# -- .dockerignore, as docker reads it ------------------------------------------------------
def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rx = ""
        i = 0
        while i < len(pattern):
            c = pattern[i]
            if pattern.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
                continue
            if pattern.startswith("**", i):
                rx += ".*"
                i += 2
                continue
            rx += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c))
            i += 1
        rules.append((negate, re.compile(rx + "(?:/.*)?$")))  # a directory excludes what is under it
    return rules


def ignored(path: str) -> bool:
    result = False
    for negate, rx in dockerignore_patterns():
        if rx.match(path):
            result = not negate
    return result


# -- static checks ----------------------------------------------------------------------------
@pytest.fixture(params=sorted(DOCKERFILES), scope="module")
def dockerfile(request) -> tuple[str, Path, list[Instruction], list[Stage]]:
    path = DOCKERFILES[request.param]
    head, stages = read_dockerfile(path)
    return request.param, path, head, stages


def test_stages(dockerfile):
    kind, path, head, stages = dockerfile
    assert [s.name for s in stages] == ["build", "runtime"], f"{path}: a build stage and a runtime stage"
    base_arg = {"cpu": "BASE_IMAGE", "cuda": "CUDA_BASE_IMAGE"}[kind]
    args = {i.args.split("=")[0] for i in head if i.name == "ARG"}
    assert base_arg in args, f"{path}: the base image is the build argument {base_arg}"
    assert all(s.base == "${%s}" % base_arg for s in stages), f"{path}: both stages start FROM ${{{base_arg}}}"
    runtime = stages[-1]
    copies = [copy_parts(c) for c in runtime.all("COPY")]
    assert copies and all(flags.get("from") == "build" for flags, _, _ in copies), \
        f"{path}: the runtime stage takes only the build stage's environment, not the sources"


def test_entrypoint_user_healthcheck(dockerfile):
    kind, path, head, stages = dockerfile
    runtime = stages[-1]
    (entry,) = runtime.all("ENTRYPOINT")
    assert exec_form(entry.args) == ["kvtier"], "k8s args: [\"serve\", ...] must reach the kvtier CLI"
    (cmd,) = runtime.all("CMD")
    assert exec_form(cmd.args) == ["serve"]
    users = runtime.all("USER")
    assert users, f"{path}: the runtime stage sets USER"
    user = users[-1].args
    uid, _, gid = user.partition(":")
    arg_values = dict(i.args.split("=", 1) for i in runtime.all("ARG") if "=" in i.args)
    resolve = lambda v: arg_values.get(v[2:-1], v) if v.startswith("${") else v  # noqa: E731
    assert resolve(uid) not in ("root", "0", ""), f"{path}: the daemon runs as a non-root uid, got {user}"
    assert resolve(gid) == str(KVTIER_GID), f"{path}: the daemon's group is the shared gid {KVTIER_GID}"
    (health,) = runtime.all("HEALTHCHECK")
    assert "CMD" in health.args and "health-check" in health.args
    env = " ".join(i.args for i in runtime.all("ENV"))
    assert "KVTIER_SOCKET=/run/kvtier/kvtier.sock" in env, "health-check and serve agree on the socket"
    assert "KVTIER_CACHE_DIR=/var/cache/kvtier" in env
    runs = " ".join(i.args for i in runtime.all("RUN"))
    assert re.search(r"install -d [^&]*-g \"?\$\{KVTIER_GID\}\"? -m 2770 /run/kvtier /var/cache/kvtier", runs), \
        f"{path}: the socket and cache directories are the shared group's, setgid"


def test_copy_sources_exist_and_are_in_the_context(dockerfile):
    kind, path, head, stages = dockerfile
    names = set()
    for stage in stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            assert ins.name == "COPY", f"{path}:{ins.line}: use COPY, not ADD"
            flags, sources, _ = copy_parts(ins)
            if "from" in flags:
                assert flags["from"] in names, f"{path}:{ins.line}: --from={flags['from']} is no earlier stage"
                continue
            for src in sources:
                rel = src.rstrip("/")
                assert (ROOT / rel).exists(), f"{path}:{ins.line}: COPY source {src} is not in the repository"
                assert not ignored(rel), f"{path}:{ins.line}: COPY source {src} is excluded by .dockerignore"
        if stage.name:
            names.add(stage.name)


def test_what_is_installed(dockerfile):
    kind, path, head, stages = dockerfile
    build_runs = " ".join(i.args for i in stages[0].all("RUN"))
    assert "pip install --no-cache-dir ./client ." in build_runs, "both packages from this checkout"
    assert "torch" not in path.read_text().split("# ---", 1)[1], f"{path}: torch stays out of the daemon image"
    if kind == "cuda":
        assert "CUPY_PACKAGE" in build_runs
    else:
        assert "cupy" not in build_runs.lower()


def test_dockerignore():
    for path in (".venv/bin/python", ".git/HEAD", ".git", "kvtier/__pycache__/cli.cpython-311.pyc",
                 "client/kvtier_client/__pycache__/client.cpython-311.pyc", ".pytest_cache/v/cache",
                 ".hypothesis/examples/x", "kvtier.egg-info/PKG-INFO", "client/kvtier_client.egg-info/PKG-INFO",
                 "benchmarks/results/2026-11-30/e2e.png", ".venv-vllm/bin/python"):
        assert ignored(path), f".dockerignore lets {path} into the build context"
    for path in ("pyproject.toml", "README.md", "kvtier/cli.py", "client/pyproject.toml",
                 "cuda/page_copy.cu", "client/kvtier_client/proto/v1/kvtier_pb2.py"):
        assert not ignored(path), f".dockerignore drops {path}, which the images are built from"


def test_build_script():
    assert os.access(BUILD_SCRIPT, os.X_OK)
    subprocess.run(["bash", "-n", str(BUILD_SCRIPT)], check=True, timeout=10)
    text = BUILD_SCRIPT.read_text()
    for engine in ("docker", "podman", "buildah"):
        assert engine in text
    assert "--format docker" in text, "podman and buildah keep HEALTHCHECK only in the docker format"
    for path in DOCKERFILES.values():
        assert str(path.relative_to(ROOT)) in text


# -- the real thing -----------------------------------------------------------------------------
def _engine() -> str | None:
    wanted = os.environ.get("KVTIER_ENGINE")
    for engine in [wanted] if wanted else ["docker", "podman"]:
        if engine in ("docker", "podman") and shutil.which(engine):
            if subprocess.run([engine, "info"], capture_output=True, timeout=60).returncode == 0:
                return engine
    return None


CLIENT = textwrap.dedent("""
    import sys
    import numpy as np
    from kvtier_client import Backoff, KVTierClient, PageLayout

    layout = PageLayout(layers=4, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
    with KVTierClient("unix://" + sys.argv[1], name="image test", backoff=Backoff(total=float(sys.argv[3]) if len(sys.argv) > 3 else 20.0)) as kv:
        kv.register(sys.argv[2], layout)
        keys = kv.block_keys(list(range(128)))
        assert kv.lookup(keys).hit_blocks == 0
        data = np.random.default_rng(7).standard_normal((len(keys), *layout.shape)).astype(np.float16)
        with kv.borrow(len(keys)) as lease:
            for page, values in zip(lease.pages, data):
                page[...] = values
            lease.commit(keys)
        hit = kv.lookup(keys).hit_blocks
        assert hit == len(keys), hit
        with kv.acquire(keys) as read:
            assert read.ready == len(keys)
            equal = all(np.array_equal(p.view(np.uint8), d.view(np.uint8)) for p, d in zip(read.pages, data))
        assert equal, "bytes read back differ"
        print("ROUND TRIP OK", len(keys), "pages")
""")


def _inspect(engine: str, image: str) -> dict:
    out = subprocess.run([engine, "image", "inspect", image], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)[0]


@pytest.fixture(scope="module")
def cpu_image() -> tuple[str, str]:
    """(engine, image): the CPU image built from this checkout once for the module's real
    tests, removed after them."""
    if os.environ.get("KVTIER_TEST_IMAGES") != "1":
        pytest.skip("set KVTIER_TEST_IMAGES=1 (builds for minutes)")
    engine = _engine()
    if engine is None:
        pytest.skip("no working container engine (docker with a daemon, or podman)")
    if os.geteuid() != 0:
        pytest.skip("the host client needs root here (or membership of group 2000) to reach the socket")
    tag = f"test-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, KVTIER_ENGINE=engine, KVTIER_TAG=tag)
    subprocess.run([str(BUILD_SCRIPT), "cpu"], cwd=ROOT, env=env, check=True, timeout=1800)
    yield engine, f"kvtier:{tag}"
    subprocess.run([engine, "rmi", f"kvtier:{tag}"], capture_output=True, timeout=120)


def test_cpu_image_serves_a_client_on_the_host(tmp_path, cpu_image):
    engine, image = cpu_image
    name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    try:
        inspected = _inspect(engine, image)
        config = inspected["Config"]
        health = config.get("Healthcheck") or inspected.get("Healthcheck")  # docker | podman
        assert config["Entrypoint"] == ["kvtier"] and config["Cmd"] == ["serve"]
        assert config["User"] == f"10001:{KVTIER_GID}"
        assert health and "health-check" in " ".join(health["Test"]), "HEALTHCHECK kept (docker image format)"
        uid = 10001
        # The socket directory, shared with the host at the same path (the daemon tells
        # clients the handoff socket's path), owned as the image makes /run/kvtier.
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        os.chown(run_dir, uid, KVTIER_GID)
        os.chmod(run_dir, 0o2770)
        sock = run_dir / "kvtier.sock"
        script = tmp_path / "client.py"
        script.write_text(CLIENT)
        subprocess.run([engine, "run", "-d", "--name", name, "-v", f"{run_dir}:{run_dir}", "-e", f"KVTIER_SOCKET={sock}",
                        image, "serve", "--host-size", "64MiB", "--disk-size", "128MiB", "--log-format", "text"],
                       check=True, timeout=120)
        deadline = time.monotonic() + 60
        while subprocess.run([engine, "exec", name, "kvtier", "health-check"], capture_output=True,
                             timeout=30).returncode != 0:
            assert time.monotonic() < deadline, "the daemon did not report SERVING within 60 s"
            time.sleep(1)
        if engine == "podman":  # the image's HEALTHCHECK, run once by hand
            subprocess.run(["podman", "healthcheck", "run", name], check=True, capture_output=True, timeout=60)
        st = sock.stat()
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o660, uid, KVTIER_GID)

        # A client on the host: this checkout's kvtier_client.
        out = subprocess.run([sys.executable, str(script), str(sock), "host/model"], capture_output=True, text=True,
                             timeout=120, cwd="/")
        assert out.returncode == 0 and "ROUND TRIP OK" in out.stdout, out.stdout + out.stderr
        # An engine container: another uid, the shared group only.
        mounts = ["-v", f"{run_dir}:{run_dir}", "-v", f"{script}:/client.py:ro", "--entrypoint", "python"]
        out = subprocess.run([engine, "run", "--rm", "--user", f"10002:{KVTIER_GID}", *mounts, image,
                              "/client.py", str(sock), "engine/model"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "ROUND TRIP OK" in out.stdout, out.stdout + out.stderr
        # Outside the group: refused.
        out = subprocess.run([engine, "run", "--rm", "--user", "10003:3000", *mounts, image,
                              "/client.py", str(sock), "other/model", "2"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "Permission denied" in out.stdout + out.stderr, out.stdout + out.stderr

        subprocess.run([engine, "stop", "-t", "30", name], check=True, capture_output=True, timeout=60)
        code = subprocess.run([engine, "inspect", "--format", "{{.State.ExitCode}}", name], capture_output=True,
                              text=True, check=True, timeout=60).stdout.strip()
        assert code == "0", "SIGTERM drains and exits 0"
    finally:
        logs = subprocess.run([engine, "logs", name], capture_output=True, text=True)
        print(logs.stdout, logs.stderr)
        subprocess.run([engine, "rm", "-f", name], capture_output=True, timeout=60)


# -- warm restart in a pod: the arena keeper in a container of its own ----------------------
PAGES = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kvtier_client import KVTierClient, PageLayout

    layout = PageLayout(layers=4, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
    sock, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = np.random.default_rng(11).standard_normal((count, *layout.shape)).astype(np.float16)
    with KVTierClient("unix://" + sock, name="pod test") as kv:
        kv.register("pod/model", layout)
        keys = [kv.block_keys([i] * layout.block_tokens)[0] for i in range(count)]  # independent one-page prefixes
        if mode == "write":
            for first in range(0, count, 128):
                with kv.borrow(len(keys[first:first + 128])) as lease:
                    for page, values in zip(lease.pages, data[first:first + 128]):
                        page[...] = values
                    lease.commit(keys[first:first + 128])
            print(json.dumps({"written": count}))
        else:
            hits = equal = 0
            for key, values in zip(keys, data):
                if kv.lookup([key]).hit_blocks:
                    hits += 1
                    with kv.acquire([key]) as read:
                        equal += read.ready == 1 and np.array_equal(read.pages[0].view(np.uint8), values.view(np.uint8))
            print(json.dumps({"hits": hits, "equal": equal}))
""")
KEEPER_DIR = "/run/kvtier-keeper"  # the pod's `keeper` emptyDir, as deploy/ mounts it
KEEPER_SOCKET = f"{KEEPER_DIR}/keeper.sock"
POD_PAGES = 1024  # 32 KiB each: 32 MiB of a 64 MiB host tier


def _shared_dir(path: Path) -> Path:
    """A volume of the pod, owned as the image makes its directories (10001:2000, 2770)."""
    path.mkdir()
    os.chown(path, 10001, KVTIER_GID)
    os.chmod(path, 0o2770)
    return path


def _serving(sock: Path, timeout: float = 60.0) -> float:
    """Seconds until the daemon at `sock` reports SERVING (gRPC health, from the host)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if sock.exists():
            with grpc.insecure_channel(f"unix://{sock}") as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - began
                except grpc.RpcError:
                    pass
        time.sleep(0.05)
    raise AssertionError(f"no daemon SERVING at {sock} after {timeout:.0f} s")


@dataclass
class Pod:
    """A podman pod as Kubernetes would run kvtier in it: volumes for the socket directory
    (shared with the host at the same path, for the host's client), the cache directory and,
    with a keeper, the keeper's socket."""

    image: str
    name: str
    base: Path
    keeper: bool
    containers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run_dir = _shared_dir(self.base / "run")
        self.cache_dir = _shared_dir(self.base / "cache")
        self.keeper_dir = _shared_dir(self.base / "keeper")
        self.sock = self.run_dir / "kvtier.sock"
        subprocess.run(["podman", "pod", "create", "--name", self.name], check=True, capture_output=True, timeout=60)

    def run(self, name: str, *args: str, entrypoint: str = "") -> str:
        full = f"{self.name}-{name}"
        volumes = ["-v", f"{self.run_dir}:{self.run_dir}", "-v", f"{self.cache_dir}:/var/cache/kvtier",
                   "-v", f"{self.keeper_dir}:{KEEPER_DIR}"]
        env = ["-e", f"KVTIER_SOCKET={self.sock}"]
        if self.keeper:
            env += ["-e", f"KVTIER_KEEPER_SOCKET={KEEPER_SOCKET}"]
        first = ["--entrypoint", entrypoint] if entrypoint else []
        subprocess.run(["podman", "run", "-d", "--pod", self.name, "--name", full, *volumes, *env, *first, self.image,
                        *args], check=True, capture_output=True, timeout=120)
        self.containers.append(full)
        return full

    def start_keeper(self) -> str:
        """The kvtier-keeper sidecar: `kvtier keeper ...` where the CLI has it, else its module."""
        args = ["--socket", KEEPER_SOCKET, "--window", "5m"]
        registered = subprocess.run(["podman", "run", "--rm", self.image, "keeper", "--help"], capture_output=True,
                                    timeout=120).returncode == 0
        name = (self.run("keeper", "keeper", *args) if registered
                else self.run("keeper", "-m", "kvtier.keeper_cli", *args, entrypoint="python"))
        deadline = time.monotonic() + 60
        while self.check_keeper().returncode != 0:
            assert time.monotonic() < deadline, "the keeper container did not answer its probe within 60 s"
            time.sleep(0.2)
        return name

    def check_keeper(self) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", "exec", f"{self.name}-keeper", "python", "-m", "kvtier.keeper_cli", "--check",
                               "--socket", KEEPER_SOCKET], capture_output=True, text=True, timeout=60)

    def start_daemon(self, name: str) -> tuple[str, float]:
        """A daemon container: (its name, seconds from its start to SERVING)."""
        began = time.monotonic()
        full = self.run(name, "serve", "--host-size", "64MiB", "--disk-size", "128MiB", "--log-format", "text")
        return full, time.monotonic() - began + _serving(self.sock)

    def pages(self, script: Path, mode: str) -> dict:
        out = subprocess.run([sys.executable, str(script), str(self.sock), mode, str(POD_PAGES)], capture_output=True,
                             text=True, timeout=300, cwd="/")
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    def logs(self) -> str:
        return "\n".join(f"--- {c} ---\n" + subprocess.run(["podman", "logs", c], capture_output=True, text=True).stderr
                         for c in self.containers)

    def remove(self) -> None:
        subprocess.run(["podman", "pod", "rm", "-f", self.name], capture_output=True, timeout=120)


def _kill_and_restart(pod: Pod, script: Path) -> tuple[dict, float]:
    """Write the pages, `podman kill` the daemon container, start a new one in the pod:
    (what the new one finds of them, its seconds to SERVING)."""
    first, _ = pod.start_daemon("kvtier")
    assert pod.pages(script, "write") == {"written": POD_PAGES}
    subprocess.run(["podman", "kill", first], check=True, capture_output=True, timeout=60)
    subprocess.run(["podman", "wait", first], capture_output=True, timeout=60)  # kept: its logs
    _, seconds = pod.start_daemon("kvtier-restarted")
    return pod.pages(script, "read"), seconds


def test_a_keeper_container_keeps_host_pages_across_a_daemon_container_kill(tmp_path, cpu_image):
    engine, image = cpu_image
    if engine != "podman":
        pytest.skip("the pod test uses podman pods")
    script = tmp_path / "pages.py"
    script.write_text(PAGES)
    tag = uuid.uuid4().hex[:8]
    warm = Pod(image, f"kvtier-warm-{tag}", _shared_dir(tmp_path / "warm"), keeper=True)
    cold = Pod(image, f"kvtier-cold-{tag}", _shared_dir(tmp_path / "cold"), keeper=False)
    try:
        warm.start_keeper()
        found, warm_s = _kill_and_restart(warm, script)
        assert found == {"hits": POD_PAGES, "equal": POD_PAGES}, warm.logs()
        assert "adopted host arena" in warm.logs()
        # A clean stop frees what the keeper holds and leaves it running for the next daemon.
        subprocess.run(["podman", "stop", "-t", "30", f"{warm.name}-kvtier-restarted"], check=True, capture_output=True,
                       timeout=60)
        probe = warm.check_keeper()
        assert probe.returncode == 0 and "0 files kept, no daemon holds it" in probe.stdout, probe.stdout + probe.stderr

        found_cold, cold_s = _kill_and_restart(cold, script)
        assert found_cold == {"hits": 0, "equal": 0}, "without the keeper container the host tier dies with the daemon's"
        print(f"pod warm restart: {found['hits']}/{POD_PAGES} pages kept with the keeper container, "
              f"{found_cold['hits']}/{POD_PAGES} without; new daemon container to SERVING {warm_s:.2f} s with the "
              f"keeper, {cold_s:.2f} s without ({warm_s / cold_s:.2f}x)")
    finally:
        print(warm.logs(), cold.logs())
        warm.remove()
        cold.remove()
