"""The node's peak-memory figure is its own, whatever launched it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from geotrain.node._memory import peak_rss_mb

# A parent that holds 1.2 GB (touched), frees it, then starts a child that reports its peak:
# getrusage's ru_maxrss would hand the child the parent's 1.2 GB across fork and exec.
PARENT = """
import subprocess, sys
held = b"\\x01" * 1_200_000_000
del held
child = "from geotrain.node._memory import peak_rss_mb; print(peak_rss_mb())"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                     check=True).stdout)
"""


def test_a_process_started_by_a_big_one_reports_its_own_peak():
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    child_mb = float(out.stdout.strip())
    # the child imports torch and geotrain (about 300 MB), nowhere near its parent's 1.2 GB
    assert 5 < child_mb < 800, child_mb


def test_the_peak_grows_with_what_this_process_holds():
    before = peak_rss_mb()
    held = b"\x01" * 200_000_000
    assert peak_rss_mb() >= before and peak_rss_mb() > 200, (before, peak_rss_mb())
    del held


# Every rule that checks or mixes a model works a slice at a time: on a 100 MB tensor none may
# peak more than a few slices above what the process held before it (a whole-tensor temporary,
# such as torch.isfinite(x).all() at 1.7x the tensor or x - y at 1x, fails this). The child
# resets its high-water mark (/proc/self/clear_refs) before each rule.
MIXES = """
import json, re, torch
torch.set_num_threads(1)
from geotrain import gossip
from geotrain.node._allocator import tune_allocator
tune_allocator()
def rss():
    s = open("/proc/self/status").read()
    return [int(re.search(k + r":\\s+(\\d+)", s).group(1)) / 1024 for k in ("VmRSS", "VmHWM")]
n = 5000
own, a, b = ({"w": torch.randn(n, n)} for _ in range(3))
sent = {"w": own["w"].clone()}
out = {}
def rule(name, fn):
    open("/proc/self/clear_refs", "w").write("5")
    before = rss()[0]
    fn()
    out[name] = rss()[1] - before
radius = gossip.ClipRadius("clip")
rule("check_update", lambda: gossip.check_update(own, a, max_norm_ratio=10.0))
rule("pairwise_mix", lambda: gossip.pairwise_mix(own, sent, a, clip=1.0))
rule("neighbourhood_mix", lambda: gossip.neighbourhood_mix(own, sent, {"a": a, "b": b},
                                                           {"a": 0.3, "b": 0.3}))
rule("clipped_neighbourhood_mix", lambda: gossip.clipped_neighbourhood_mix(
    own, sent, {"a": a, "b": b}, {"a": 0.3, "b": 0.3}, radius))
rule("choco_consensus", lambda: gossip.choco_consensus(own, sent, a, gamma=0.5, radius=radius))
rule("robust_average", lambda: gossip.robust_average(own, [a, b], "clip", radius, out=a))
outer = gossip.NesterovOuter(0.7, 0.9)
outer.step(sent, b)  # (the first step makes the momentum buffer)
rule("NesterovOuter.step", lambda: outer.step(sent, b))
half = gossip.NesterovOuter(0.7, 0.9, torch.bfloat16)  # (a mixed-dtype op on the CPU widens
half.step(sent, b)  # its narrower operand whole: a diloco node's bfloat16 momentum did)
rule("NesterovOuter.step, bfloat16 momentum", lambda: half.step(sent, b))
print(json.dumps(out))
"""


def test_checks_and_mixes_hold_no_model_sized_temporary():
    import json

    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("this kernel does not let a process reset its memory high-water mark")
    done = subprocess.run([sys.executable, "-c", MIXES], capture_output=True, text=True,
                          check=True, timeout=300)  # fmt: skip
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    tensor_mb = 5000 * 5000 * 4 / 2**20  # 95 MiB
    # a whole-tensor temporary is 95 MiB or more; slices of 4 MiB and the allocator's arenas
    # stay well under 40% (pairwise_mix peaked at 24 MiB once, with another process's load)
    too_big = {rule: round(mb) for rule, mb in peaks.items() if mb > 0.4 * tensor_mb}
    assert not too_big, f"peak MiB above 40% of the {tensor_mb:.0f} MiB model: {too_big}"


# Chunk buffers (below the 16 MiB mmap threshold) come from malloc's arenas, which shrink only
# from the top: 800 MB of them freed between small blocks that outlive them stay in the process
# until release_free_memory gives them back (what diloco does after each round end).
ARENA = """
import re, threading, torch
from geotrain.node._allocator import release_free_memory, tune_allocator
assert tune_allocator()
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
base = rss()
chunks, kept = [], []
def work():  # (in a worker thread, as the node's tensor work: its own arena)
    for _ in range(200):
        chunks.append(torch.ones(1 << 20))  # 4 MiB, touched
        kept.append(torch.ones(300))
    chunks.clear()
worker = threading.Thread(target=work)
worker.start()
worker.join()
held = rss()
release_free_memory()
print(base, held, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_chunk_buffers_go_back_to_the_system_after_a_round_end():
    out = subprocess.run([sys.executable, "-c", ARENA], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    base, held, after = (float(x) for x in out.stdout.split())
    assert held - base > 600, (base, held)  # (what it is for: freed, yet held)
    assert after - base < 100, (base, held, after)


def test_the_memory_bench_says_how_many_chunks_a_stream_could_keep_in_flight_at_a_peak():
    from geotrain.node.bench.memory import widest_window

    model = 4e8  # 10^8 float32: 48 chunks of 8 MiB
    assert widest_window([], model) is None  # no link measured yet
    assert widest_window([(0.2, 5000.0)], model) == 4  # loopback: the least window
    # a loaded box's loopback at 30 ms, or 1 Gbit/s at 150 ms, would widen it (to 7, to 8), but
    # a 10^8 model's window stays at 32 MiB: what the memory estimate counts
    assert widest_window([(0.2, 5000.0), (30.0, 4000.0)], model) == 4
    assert widest_window([(150.0, 1000.0)], model) == 4
    assert widest_window([(150.0, 1000.0)], 4e9) == 8  # 10^9: WINDOW_BYTES of chunks
    assert widest_window([(150.0, 1000.0)], 2e7) == 3  # never more than the stream's chunks
