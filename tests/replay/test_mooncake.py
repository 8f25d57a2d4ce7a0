"""`kvtier replay`: the real console script on the Mooncake trace and on hand-worked traces."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.replay.mooncake import read_trace, replay

KVTIER = str(Path(sys.executable).parent / "kvtier")

# Four requests, ten blocks. Worked by hand below for each configuration.
TINY = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]]


def run_replay(trace: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVTIER, "replay", str(trace), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def tiny_trace(tmp_path) -> Path:
    path = tmp_path / "tiny.jsonl"
    lines = [json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) for i, ids in enumerate(TINY)]
    lines.insert(2, "")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_conversation_trace_matches_the_published_lru_figure(mooncake_trace):
    out = run_replay(mooncake_trace, "--host-pages", "5859", "--policy", "lru", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    # The trace's README: one-tier LRU of 5,859 blocks, touched in request order -> 0.136.
    assert round(data["block_hit_rate"], 3) == 0.136
    assert (data["requests"], data["blocks"]) == (12031, 288500)
    assert data["tier_hit_rates"] == {"host": data["block_hit_rate"], "disk": 0.0}


# Hand-worked hit rates (hits / 10 looked-up blocks):
#
# one tier, 3 pages, lru:
#   R1 [1,2,3] 0 hits; cache 1,2,3 (oldest first)
#   R2 [1,2,4] 2 hits (1,2); touching 1,2 gives 3,1,2; inserting 4 evicts 3 -> 1,2,4
#   R3 [5]     0 hits; evicts 1 -> 2,4,5
#   R4 [1,2,3] 0 hits (1 is gone)                                      total 2/10 = 0.2
# one tier, 3 pages, prefix:
#   R1 0 hits; chain 1->2->3
#   R2 2 hits; 4 needs room: the only leaf is 3 -> 1,2,4 (4 a child of 2)
#   R3 0 hits; the only leaf is 4 -> 1,2,5
#   R4 2 hits (1,2: the prefix survived)                              total 4/10 = 0.4
# two tiers, host 2 + disk 2 (write-back), lru (hits counted in the fastest tier):
#   R1 0 hits; 3 demotes 1 -> host 2,3 disk 1
#   R2 1 from disk, 2 from host; promoting 1 demotes 2 (disk 1,2); promoting 2 demotes
#      3, which pushes 1's disk copy out (disk 2,3); inserting 4 demotes 1, pushing out
#      2's disk copy -> host 2,4 disk 3,1
#   R3 0 hits; 5 demotes 2, which drops 3 for good -> host 4,5 disk 1,2
#   R4 1 and 2 from disk, 3 gone                        total 4/10: host 1/10, disk 3/10
# two tiers, prefix:
#   R1 0 hits; inserting 3 evicts the leaf 2 (3 is not cached yet) -> host 1,3 disk 2
#   R2 1 from host, 2 from disk; promoting 2 evicts the leaf 3 (older than 1) -> disk 2,3;
#      inserting 4 evicts 2's host copy (it has a disk copy) -> host 1,4
#   R3 0 hits; 5 evicts 1, whose demotion drops the disk leaf 3 -> host 4,5 disk 2,1
#   R4 1 and 2 from disk, 3 gone                        total 4/10: host 1/10, disk 3/10
EXPECTED = {
    ("lru", 3, 0): (0.2, 0.2, 0.0),
    ("prefix", 3, 0): (0.4, 0.4, 0.0),
    ("lru", 2, 2): (0.4, 0.1, 0.3),
    ("prefix", 2, 2): (0.4, 0.1, 0.3),
}


@pytest.mark.parametrize("policy, host, disk", list(EXPECTED))
def test_tiny_trace_hit_rates(tiny_trace, policy, host, disk):
    out = run_replay(tiny_trace, "--host-pages", str(host), "--disk-pages", str(disk), "--policy", policy, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    total, from_host, from_disk = EXPECTED[(policy, host, disk)]
    assert (data["requests"], data["blocks"], data["policy"]) == (4, 10, policy)
    assert data["block_hit_rate"] == pytest.approx(total)
    assert data["tier_hit_rates"] == pytest.approx({"host": from_host, "disk": from_disk})
    # The library call gives the same answer as the command.
    result = replay(read_trace(str(tiny_trace)), host_pages=host, disk_pages=disk, policy=policy)
    timed = ("policy_seconds", "policy_blocks_per_second")  # timings differ run to run
    assert data.pop("disk_codec") == {"codec": "identity", "ratio": 1.0, "source": "identity: pages stored as they are",
                                      "raw_disk_pages": disk}
    assert {k: v for k, v in result.as_dict().items() if k not in timed} == {k: v for k, v in data.items() if k not in timed}
    assert data["policy_seconds"] > 0


def test_table_output(tiny_trace):
    out = run_replay(tiny_trace, "--host-pages", "3")
    assert out.returncode == 0, out.stderr
    assert "4 requests, 10 blocks" in out.stdout
    assert "block hit rate 0.2000" in out.stdout


def test_an_unbounded_cache_hits_every_repeated_prefix(tiny_trace):
    # With room for everything, a block hits whenever its whole prefix was seen before:
    # R2 hits 1,2; R4 hits 1,2,3 -> 5/10, whatever the policy.
    for policy in ("lru", "prefix"):
        assert replay(TINY, host_pages=100, policy=policy).block_hit_rate == 0.5


@pytest.mark.parametrize(
    "line, reason",
    [
        ("not json", "Expecting value"),
        ('{"timestamp": 1}', 'no "hash_ids" field'),
        ("[1, 2]", 'no "hash_ids" field'),
        ('{"hash_ids": "123"}', "hash_ids must be a list"),
        ('{"hash_ids": [1, -4]}', "hash id -4 is not an integer"),
        ('{"hash_ids": [1.5]}', "hash id 1.5 is not an integer"),
        ('{"hash_ids": [true]}', "hash id True is not an integer"),
        ('{"hash_ids": [3, null]}', "hash id None is not an integer"),
        ('{"hash_ids": [18446744073709551616]}', "hash id 18446744073709551616 is not an integer"),
    ],
)
def test_malformed_trace_gives_one_line_error(tmp_path, line, reason):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"hash_ids": [1, 2]}\n' + line + "\n")
    out = run_replay(trace, "--json")
    assert out.returncode != 0
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"Error: {trace}:2: not a Mooncake trace line")
    assert reason in lines[0]


def test_device_tier_on_top_keeps_the_hit_rate_and_serves_repeats(tiny_trace):
    """Acquires into a device tier climb disk -> host -> device; the device is inclusive
    (host keeps its copy), so the total hit rate is the host+disk one and the repeats that
    stay hot are served from the device."""
    base = replay(read_trace(str(tiny_trace)), host_pages=2, disk_pages=2, policy="lru")
    with_device = replay(read_trace(str(tiny_trace)), host_pages=2, disk_pages=2, policy="lru", device_pages=2)
    assert with_device.block_hit_rate == pytest.approx(base.block_hit_rate)
    assert with_device.device_hit_blocks > 0
    data = with_device.as_dict()
    assert sum(data["tier_hit_rates"].values()) == pytest.approx(data["block_hit_rate"])


def test_second_half_counts_only_the_later_requests(tiny_trace):
    # TINY's timestamps are 0..3: the second half by time starts at request 2 ([5], [1,2,3]).
    # With lru on 3 pages (worked above) R3 and R4 hit nothing: 0 of 4 blocks.
    out = run_replay(tiny_trace, "--host-pages", "3", "--policy", "lru", "--second-half", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["requests"], data["blocks"], data["block_hit_rate"]) == (2, 4, 0.0)
    # With prefix, R4's prefix survived: 2 of 4.
    out = run_replay(tiny_trace, "--host-pages", "3", "--policy", "prefix", "--second-half")
    assert "block hit rate 0.5000" in out.stdout and "second half, from request 2" in out.stdout
    assert "policy speed" in out.stdout
